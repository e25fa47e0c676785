//! TLS for client connections (rustls with the ring provider).

use anyhow::{anyhow, Context as _};
use lokadb_shared::config::TlsConfig;
use std::sync::Arc;

/// Builds the server-side TLS configuration from PEM files.
///
/// # Errors
///
/// A message naming the file that is missing or holds no usable certificate or key.
pub fn server_config(tls: &TlsConfig) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let certs = rustls_pemfile::certs(&mut open(&tls.cert)?)
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("reading certificates from {}", tls.cert.display()))?;
    if certs.is_empty() {
        return Err(anyhow!("no certificate found in {}", tls.cert.display()));
    }
    let key = rustls_pemfile::private_key(&mut open(&tls.key)?)
        .with_context(|| format!("reading private key from {}", tls.key.display()))?
        .ok_or_else(|| anyhow!("no private key found in {}", tls.key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("certificate and key do not match")?;
    // Clients using `sslnegotiation=direct` (libpq 17+) require this ALPN.
    config.alpn_protocols = vec![b"postgresql".to_vec()];
    Ok(Arc::new(config))
}

fn open(path: &std::path::Path) -> anyhow::Result<std::io::BufReader<std::fs::File>> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    Ok(std::io::BufReader::new(f))
}
