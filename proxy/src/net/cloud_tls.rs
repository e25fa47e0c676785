//! TLS from the proxy to the cloud, as the `cloud` connection string's `sslmode`,
//! `sslrootcert`, `sslcert` and `sslkey` say (libpq's meanings): one rustls client
//! configuration per database, used by the pool's connections on the cores' rings and by
//! the watcher, the resolver and the admin commands through the `postgres` crate.

use super::stream::{ServerStream, Stream};
use crate::rt::net::TcpStream;
use anyhow::Context as _;
use futures_lite::{AsyncReadExt, AsyncWriteExt};
use lokadb_shared::conninfo::{SslMode, TlsOptions};
use lokadb_shared::wire::startup;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};
use std::fmt;
use std::io;
use std::sync::Arc;

/// How the proxy speaks TLS to one server.
pub struct CloudTls {
    /// `sslmode`.
    pub mode: SslMode,
    config: Arc<rustls::ClientConfig>,
    name: ServerName<'static>,
}

impl fmt::Debug for CloudTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CloudTls")
            .field("mode", &self.mode)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Why TLS to the cloud could not be set up on a connection.
#[derive(Debug)]
pub enum TlsError {
    /// The socket failed.
    Io(io::Error),
    /// The server answered the SSLRequest with `N` and `sslmode` requires TLS.
    Refused(SslMode),
    /// The server answered the SSLRequest with something else than `S` or `N`.
    Unexpected(u8),
    /// The handshake failed (a certificate not trusted, not for the host, …).
    Handshake(io::Error),
}

impl fmt::Display for TlsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TlsError::Io(e) => write!(f, "{e}"),
            TlsError::Refused(mode) => write!(
                f,
                "the server does not accept TLS connections, and sslmode={} requires TLS",
                mode.as_str()
            ),
            TlsError::Unexpected(b) => write!(
                f,
                "the server answered the TLS request with byte {b:#04x}, not S or N"
            ),
            TlsError::Handshake(e) => write!(f, "TLS handshake failed: {e}"),
        }
    }
}

impl CloudTls {
    /// The TLS of a connection to `host` with `opts`; `None` when it never asks for TLS.
    ///
    /// # Errors
    ///
    /// A message naming the certificate or key file that cannot be used, or a host that
    /// is no valid server name.
    pub fn new(opts: &TlsOptions, host: &str) -> anyhow::Result<Option<CloudTls>> {
        if !opts.mode.asks_tls() {
            return Ok(None);
        }
        let provider = super::tls::provider();
        let chain = match (&opts.rootcert, opts.verifies_chain()) {
            (Some(path), true) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in super::tls::certs(path)? {
                    roots.add(cert).with_context(|| {
                        format!(
                            "sslrootcert {}: a certificate is not usable",
                            path.display()
                        )
                    })?;
                }
                Some(
                    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                        .build()
                        .with_context(|| format!("sslrootcert {}", path.display()))?,
                )
            }
            _ => None,
        };
        let verifier = Arc::new(Verifier {
            chain,
            names: opts.verifies_name(),
            provider: provider.clone(),
        });
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let mut config = match (&opts.cert, &opts.key) {
            (Some(cert), Some(key)) => builder
                .with_client_auth_cert(super::tls::certs(cert)?, super::tls::private_key(key)?)
                .with_context(|| {
                    format!(
                        "sslcert {} and sslkey {} do not match",
                        cert.display(),
                        key.display()
                    )
                })?,
            _ => builder.with_no_client_auth(),
        };
        // Servers that negotiate TLS directly (PostgreSQL 17+) check this ALPN.
        config.alpn_protocols = vec![b"postgresql".to_vec()];
        let name = ServerName::try_from(host.to_owned())
            .map_err(|_| anyhow::anyhow!("{host:?} is not a host name TLS can verify"))?;
        Ok(Some(CloudTls {
            mode: opts.mode,
            config: Arc::new(config),
            name,
        }))
    }

    /// Asks the server for TLS on a fresh connection and sets it up (`prefer`: plain when
    /// the server declines).
    ///
    /// # Errors
    ///
    /// [`TlsError`].
    pub async fn negotiate(&self, mut tcp: TcpStream) -> Result<ServerStream, TlsError> {
        let mut request = Vec::with_capacity(8);
        startup::encode_ssl_request(&mut request);
        tcp.write_all(&request).await.map_err(TlsError::Io)?;
        // One byte exactly: anything the server sent after it before the handshake would
        // be unauthenticated (CVE-2021-23222).
        let mut answer = [0u8; 1];
        tcp.read_exact(&mut answer).await.map_err(TlsError::Io)?;
        match answer[0] {
            b'S' => {
                let connector = futures_rustls::TlsConnector::from(self.config.clone());
                let tls = connector
                    .connect(self.name.clone(), tcp)
                    .await
                    .map_err(TlsError::Handshake)?;
                Ok(Stream::Tls(Box::new(tls)))
            }
            b'N' if self.mode.requires_tls() => Err(TlsError::Refused(self.mode)),
            b'N' => Ok(Stream::Plain(tcp)),
            other => Err(TlsError::Unexpected(other)),
        }
    }

    /// The `postgres` crate's connector for the same TLS.
    pub fn postgres_connector(&self) -> tokio_postgres_rustls::MakeRustlsConnect {
        tokio_postgres_rustls::MakeRustlsConnect::new((*self.config).clone())
    }
}

/// A login to the cloud through the `postgres` crate (the watcher's, the resolver's),
/// with its TLS.
#[derive(Clone)]
pub struct PgLogin {
    /// Where and as whom.
    pub config: postgres::Config,
    /// TLS (`None`: plain).
    pub tls: Option<Arc<CloudTls>>,
}

impl PgLogin {
    /// Connects.
    ///
    /// # Errors
    ///
    /// The crate's error: the server refused, TLS failed, …
    pub fn connect(&self) -> Result<postgres::Client, postgres::Error> {
        connect_postgres(&self.config, self.tls.as_deref())
    }
}

/// Connects with the `postgres` crate, with TLS as `tls` says (`None`: plain).
///
/// # Errors
///
/// The crate's error: the server refused, TLS failed, …
pub fn connect_postgres(
    config: &postgres::Config,
    tls: Option<&CloudTls>,
) -> Result<postgres::Client, postgres::Error> {
    match tls {
        None => {
            let mut config = config.clone();
            config.ssl_mode(postgres::config::SslMode::Disable);
            config.connect(postgres::NoTls)
        }
        Some(tls) => {
            let mut config = config.clone();
            config.ssl_mode(if tls.mode.requires_tls() {
                postgres::config::SslMode::Require
            } else {
                postgres::config::SslMode::Prefer
            });
            config.connect(tls.postgres_connector())
        }
    }
}

/// Checks the server's certificate as `sslmode` asks: not at all (`require` without
/// `sslrootcert`, `prefer`), its chain (`verify-ca`), its chain and name (`verify-full`).
/// Handshake signatures are always checked.
#[derive(Debug)]
struct Verifier {
    chain: Option<Arc<WebPkiServerVerifier>>,
    names: bool,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.names => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}
