//! TLS for client connections (rustls with the ring provider), and the PEM files both
//! directions read.

use anyhow::{anyhow, Context as _};
use lokadb_shared::config::TlsConfig;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::Path;
use std::sync::Arc;

/// Builds the server-side TLS configuration from PEM files.
///
/// # Errors
///
/// A message naming the file that is missing or holds no usable certificate or key.
pub fn server_config(tls: &TlsConfig) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let certs = certs(&tls.cert)?;
    let key = private_key(&tls.key)?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("certificate and key do not match")?;
    // Clients using `sslnegotiation=direct` (libpq 17+) require this ALPN.
    config.alpn_protocols = vec![b"postgresql".to_vec()];
    Ok(Arc::new(config))
}

/// The crypto provider of every TLS configuration the proxy makes.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificates of a PEM file (at least one).
///
/// # Errors
///
/// A message naming the file that is missing or holds none.
pub fn certs(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = rustls_pemfile::certs(&mut open(path)?)
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("reading certificates from {}", path.display()))?;
    if certs.is_empty() {
        return Err(anyhow!("no certificate found in {}", path.display()));
    }
    Ok(certs)
}

/// The private key of a PEM file.
///
/// # Errors
///
/// A message naming the file that is missing or holds no key.
pub fn private_key(path: &Path) -> anyhow::Result<PrivateKeyDer<'static>> {
    rustls_pemfile::private_key(&mut open(path)?)
        .with_context(|| format!("reading private key from {}", path.display()))?
        .ok_or_else(|| anyhow!("no private key found in {}", path.display()))
}

fn open(path: &Path) -> anyhow::Result<std::io::BufReader<std::fs::File>> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    Ok(std::io::BufReader::new(f))
}
