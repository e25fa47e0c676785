//! Test certificates: a CA and a server certificate it signed, for `localhost` and
//! `127.0.0.1`, written as PEM files (the relay's `tls`, the agent's `--ca`).

use anyhow::Result;
use std::path::{Path, PathBuf};

/// PEM files in a directory of the caller's.
#[derive(Debug, Clone)]
pub struct TestCerts {
    /// The CA certificate agents trust.
    pub ca: PathBuf,
    /// The server certificate (signed by the CA).
    pub cert: PathBuf,
    /// The server's private key.
    pub key: PathBuf,
}

impl TestCerts {
    /// Generates a fresh CA and server certificate into `dir`.
    pub fn generate(dir: &Path) -> Result<TestCerts> {
        let ca = TestCa::new("LokaDB test CA")?;
        let (cert, key) = ca.issue("relay", &["localhost", "127.0.0.1"])?;
        let certs = TestCerts {
            ca: dir.join("ca.crt"),
            cert: dir.join("relay.crt"),
            key: dir.join("relay.key"),
        };
        std::fs::write(&certs.ca, ca.pem())?;
        std::fs::write(&certs.cert, cert)?;
        std::fs::write(&certs.key, key)?;
        Ok(certs)
    }
}

/// A throwaway CA that issues certificates for any names, as PEM text.
pub struct TestCa {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

impl TestCa {
    /// A fresh self-signed CA named `name`.
    pub fn new(name: &str) -> Result<TestCa> {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let cert = params.self_signed(&key)?;
        Ok(TestCa { cert, key })
    }

    /// The CA's certificate (PEM).
    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    /// A certificate for `names` (DNS names, or IP addresses) with common name `cn`, and
    /// its key (PEM).
    pub fn issue(&self, cn: &str, names: &[&str]) -> Result<(String, String)> {
        use rcgen::{CertificateParams, KeyPair};
        let key = KeyPair::generate()?;
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        let cert = params.signed_by(&key, &self.cert, &self.key)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}
