//! `test-certs DIR`: writes a throwaway CA (`ca.crt`) and a relay certificate it signed
//! (`relay.crt`, `relay.key`, for `localhost` and `127.0.0.1`) into DIR, for the demo and
//! the benchmarks. Not for production: use your own PKI there.

fn main() {
    let Some(dir) = std::env::args().nth(1) else {
        eprintln!("usage: test-certs DIR");
        std::process::exit(2);
    };
    match lokadb_tests::certs::TestCerts::generate(std::path::Path::new(&dir)) {
        Ok(c) => println!(
            "{}\n{}\n{}",
            c.ca.display(),
            c.cert.display(),
            c.key.display()
        ),
        Err(e) => {
            eprintln!("test-certs: {e:#}");
            std::process::exit(1);
        }
    }
}
