//! The TLS client side: the relay's certificate is verified against the CA file
//! (`--ca`, PEM, one or more certificates) for the name given by `--server-name`,
//! or else the host of `--relay` (an IP host is checked against the certificate's
//! IP addresses).

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, RootCertStore};

/// The system's CA bundle on Debian, the default for `--ca`.
pub const DEFAULT_CA_FILE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// A client configuration trusting the certificates of `ca_file`.
///
/// # Errors
///
/// The file cannot be read, or holds no usable certificate.
pub fn client_config(ca_file: &Path) -> Result<Arc<ClientConfig>, String> {
    let shown = ca_file.display();
    let certs = CertificateDer::pem_file_iter(ca_file)
        .map_err(|e| format!("cannot read the CA file {shown}: {e}"))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("cannot read the CA file {shown}: {e}"))?;
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(format!(
            "the CA file {shown} holds no usable PEM certificate"
        ));
    }
    let config = ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// The name the relay's certificate must carry: a DNS name or an IP address.
///
/// # Errors
///
/// `name` is neither.
pub fn server_name(name: &str) -> Result<ServerName<'static>, String> {
    ServerName::try_from(name.to_owned())
        .map_err(|_| format!("{name:?} is not a valid DNS name or IP address for TLS"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(matches!(
            server_name("relay.example.com"),
            Ok(ServerName::DnsName(_))
        ));
        assert!(matches!(
            server_name("10.0.0.1"),
            Ok(ServerName::IpAddress(_))
        ));
        assert!(matches!(server_name("::1"), Ok(ServerName::IpAddress(_))));
        assert!(server_name("bad name!").is_err());
    }

    #[test]
    fn ca_file_errors() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let missing = client_config(Path::new("/nonexistent/ca.pem")).unwrap_err();
        assert!(
            missing.contains("cannot read the CA file /nonexistent/ca.pem"),
            "{missing}"
        );
        let path =
            std::env::temp_dir().join(format!("lokadb-agent-empty-{}.pem", std::process::id()));
        std::fs::write(&path, "not a certificate\n").unwrap();
        let empty = client_config(&path).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert!(empty.contains("no usable PEM certificate"), "{empty}");
    }

    #[test]
    fn generated_ca_loads() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let ck = rcgen::generate_simple_self_signed(vec!["relay.test".into()]).unwrap();
        let path = std::env::temp_dir().join(format!("lokadb-agent-ca-{}.pem", std::process::id()));
        std::fs::write(&path, ck.cert.pem()).unwrap();
        let result = client_config(&path);
        std::fs::remove_file(&path).unwrap();
        result.unwrap();
    }
}
