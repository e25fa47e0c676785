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
        use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, SanType};
        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "LokaDB test CA");
        let ca = ca_params.self_signed(&ca_key)?;
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec!["localhost".to_owned()])?;
        params
            .subject_alt_names
            .push(SanType::IpAddress([127, 0, 0, 1].into()));
        let cert = params.signed_by(&key, &ca, &ca_key)?;
        let certs = TestCerts {
            ca: dir.join("ca.crt"),
            cert: dir.join("relay.crt"),
            key: dir.join("relay.key"),
        };
        std::fs::write(&certs.ca, ca.pem())?;
        std::fs::write(&certs.cert, cert.pem())?;
        std::fs::write(&certs.key, key.serialize_pem())?;
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

    /// A certificate for the DNS `names` with common name `cn`, and its key (PEM).
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
