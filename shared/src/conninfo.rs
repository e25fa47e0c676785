//! libpq connection strings: the keyword form of the configuration's `cloud`, and the TLS
//! words (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`) as libpq spells them, taken out of
//! any connection string before it reaches a client library that knows only some of them.

use std::path::PathBuf;

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    /// Never TLS.
    Disable,
    /// libpq tries without TLS first; so does the proxy, which never needs the fallback.
    Allow,
    /// TLS when the server offers it, else plain (libpq's default).
    #[default]
    Prefer,
    /// TLS or no connection; the certificate is checked only against `sslrootcert` when
    /// one is named (as libpq does when its root file exists).
    Require,
    /// TLS, and the certificate chains to `sslrootcert`.
    VerifyCa,
    /// TLS, the certificate chains to `sslrootcert` and names the host.
    VerifyFull,
}

impl SslMode {
    /// Parses libpq's spelling.
    ///
    /// # Errors
    ///
    /// A message listing the accepted values.
    pub fn parse(s: &str) -> Result<SslMode, String> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(format!(
                    "invalid sslmode {other:?}: use disable, allow, prefer, require, verify-ca or verify-full"
                ))
            }
        })
    }

    /// libpq's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// Whether the connection asks the server for TLS.
    pub fn asks_tls(self) -> bool {
        !matches!(self, SslMode::Disable | SslMode::Allow)
    }

    /// Whether a server that refuses TLS is refused.
    pub fn requires_tls(self) -> bool {
        matches!(
            self,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull
        )
    }
}

/// The TLS words of a connection string.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TlsOptions {
    /// `sslmode`.
    pub mode: SslMode,
    /// `sslrootcert`: the CA certificates (PEM) the server's certificate must chain to.
    pub rootcert: Option<PathBuf>,
    /// `sslcert`: the client's certificate chain (PEM), for servers that ask for one.
    pub cert: Option<PathBuf>,
    /// `sslkey`: the client certificate's private key (PEM).
    pub key: Option<PathBuf>,
}

impl TlsOptions {
    /// Notes `key=value` when `key` is a TLS word: `Ok(false)` when it is not.
    fn take(&mut self, key: &str, value: &str) -> Result<bool, String> {
        let path = || Some(PathBuf::from(value));
        match key {
            "sslmode" => self.mode = SslMode::parse(value)?,
            "sslrootcert" => self.rootcert = path(),
            "sslcert" => self.cert = path(),
            "sslkey" => self.key = path(),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Checks the words together.
    fn check(&self) -> Result<(), String> {
        if self.cert.is_some() != self.key.is_some() {
            return Err("sslcert and sslkey go together: name both or neither".into());
        }
        if self.rootcert.as_deref() == Some(std::path::Path::new("system")) {
            return Err(
                "sslrootcert=system is not supported: name the file of the CA certificates (PEM) your provider publishes".into(),
            );
        }
        if matches!(self.mode, SslMode::VerifyCa | SslMode::VerifyFull) && self.rootcert.is_none() {
            return Err(format!(
                "sslmode={} needs sslrootcert: the file of the CA certificates (PEM) the server's certificate must chain to",
                self.mode.as_str()
            ));
        }
        Ok(())
    }

    /// Whether the server's certificate must chain to `sslrootcert` (verify-ca,
    /// verify-full, and require with a root certificate named, as libpq does).
    pub fn verifies_chain(&self) -> bool {
        match self.mode {
            SslMode::VerifyCa | SslMode::VerifyFull => true,
            SslMode::Require => self.rootcert.is_some(),
            _ => false,
        }
    }

    /// Whether the server's certificate must name the host (verify-full).
    pub fn verifies_name(&self) -> bool {
        self.mode == SslMode::VerifyFull
    }
}

/// A parsed libpq keyword/value connection string (`host=… port=… dbname=…`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnString {
    /// Host name or address: where to connect unless `hostaddr` says, and the name a
    /// certificate must carry (`verify-full`).
    pub host: String,
    /// `hostaddr`: the numeric address to connect to, without a name lookup.
    pub hostaddr: Option<std::net::IpAddr>,
    /// Port.
    pub port: u16,
    /// Database name.
    pub dbname: Option<String>,
    /// User, if given.
    pub user: Option<String>,
    /// Password, if given.
    pub password: Option<String>,
    /// TLS to the server.
    pub tls: TlsOptions,
}

impl ConnString {
    /// Parses `key=value` pairs separated by spaces; values may be single-quoted with
    /// `\'` and `\\` escapes, as libpq accepts.
    ///
    /// # Errors
    ///
    /// A message naming the bad key or value.
    pub fn parse(s: &str) -> Result<ConnString, String> {
        if is_url(s) {
            return Err("use the keyword form \"host=… port=… dbname=…\", not a URL".into());
        }
        let mut host = None;
        let mut out = ConnString {
            host: String::new(),
            hostaddr: None,
            port: 5432,
            dbname: None,
            user: None,
            password: None,
            tls: TlsOptions::default(),
        };
        for (key, value) in pairs(s)? {
            if out.tls.take(&key, &value)? {
                continue;
            }
            match key.as_str() {
                "host" => host = Some(value),
                "hostaddr" => {
                    out.hostaddr =
                        Some(value.parse().map_err(|_| {
                            format!("invalid hostaddr {value:?}: a numeric IP address")
                        })?)
                }
                "port" => {
                    out.port = value
                        .parse()
                        .map_err(|_| format!("invalid port {value:?}"))?
                }
                "dbname" => out.dbname = Some(value),
                "user" => out.user = Some(value),
                "password" => out.password = Some(value),
                "application_name" | "connect_timeout" => {}
                other => return Err(format!("unsupported connection option {other:?}")),
            }
        }
        out.tls.check()?;
        out.host = match (host, out.hostaddr) {
            (Some(host), _) => host,
            (None, Some(addr)) => addr.to_string(),
            (None, None) => "127.0.0.1".into(),
        };
        Ok(out)
    }
}

fn is_url(s: &str) -> bool {
    s.starts_with("postgres://") || s.starts_with("postgresql://")
}

/// The `key=value` pairs of a keyword-form connection string, unquoted.
fn pairs(s: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            return Ok(out);
        }
        let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
        let key = key.trim().to_owned();
        if key.is_empty() {
            return Err("missing key before '='".into());
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek() == Some(&'\'') {
            chars.next();
            loop {
                match chars.next() {
                    None => return Err(format!("unterminated quoted value for {key:?}")),
                    Some('\\') => value.extend(chars.next()),
                    Some('\'') => break,
                    Some(c) => value.push(c),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                value.push(c);
                chars.next();
            }
        }
        out.push((key, value));
    }
}

/// Splits the TLS words off a connection string in either form libpq accepts (keywords or
/// a `postgresql://` URL): the rest, written in the same form, and the TLS options.
///
/// # Errors
///
/// A message naming what does not parse.
pub fn split_tls(dsn: &str) -> Result<(String, TlsOptions), String> {
    let mut tls = TlsOptions::default();
    let rest = if is_url(dsn) {
        let (base, query) = dsn.split_once('?').unwrap_or((dsn, ""));
        let mut kept = Vec::new();
        for param in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = param.split_once('=').unwrap_or((param, ""));
            if !tls.take(&percent_decode(key)?, &percent_decode(value)?)? {
                kept.push(param);
            }
        }
        if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        }
    } else {
        let mut kept = Vec::new();
        for (key, value) in pairs(dsn)? {
            if !tls.take(&key, &value)? {
                let quoted = value.replace('\\', "\\\\").replace('\'', "\\'");
                kept.push(format!("{key}='{quoted}'"));
            }
        }
        kept.join(" ")
    };
    tls.check()?;
    Ok((rest, tls))
}

fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("invalid percent-encoding in {s:?}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?} does not decode to UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conn_string_forms() {
        let c = ConnString::parse("host=10.1.2.3 port=6000 dbname='my db' user=u").unwrap();
        assert_eq!(c.host, "10.1.2.3");
        assert_eq!(c.port, 6000);
        assert_eq!(c.dbname.as_deref(), Some("my db"));
        assert_eq!(c.user.as_deref(), Some("u"));
        assert_eq!(c.tls, TlsOptions::default());
        let c = ConnString::parse("host=db.example hostaddr=10.0.0.7").unwrap();
        assert_eq!(c.host, "db.example");
        assert_eq!(c.hostaddr, Some([10, 0, 0, 7].into()));
        assert_eq!(
            ConnString::parse("hostaddr=10.0.0.7").unwrap().host,
            "10.0.0.7"
        );
        for (bad, says) in [
            ("host=x port=abc", "invalid port"),
            ("postgres://x/y", "keyword form"),
            ("host=x sslcompression=1", "sslcompression"),
            ("host='x", "unterminated"),
            ("host=x sslmode=verify", "invalid sslmode"),
            ("host=x sslcert=c.pem", "sslcert and sslkey go together"),
            ("host=x sslmode=verify-full", "needs sslrootcert"),
            ("host=x sslmode=verify-ca sslrootcert=system", "system"),
            ("=x", "missing key"),
            ("hostaddr=db.example", "invalid hostaddr"),
        ] {
            let e = ConnString::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn tls_words_are_read_as_libpq_reads_them() {
        let c = ConnString::parse(
            "host=db sslmode=verify-full sslrootcert='/etc/ca dir/ca.pem' sslcert=c.pem sslkey=k.pem",
        )
        .unwrap();
        assert_eq!(c.tls.mode, SslMode::VerifyFull);
        assert_eq!(c.tls.rootcert, Some(PathBuf::from("/etc/ca dir/ca.pem")));
        assert!(c.tls.verifies_chain() && c.tls.verifies_name());
        let req = |extra: &str| ConnString::parse(&format!("host=db sslmode=require{extra}"));
        assert!(!req("").unwrap().tls.verifies_chain());
        assert!(req(" sslrootcert=ca.pem").unwrap().tls.verifies_chain());
        assert!(!req(" sslrootcert=ca.pem").unwrap().tls.verifies_name());
        assert!(SslMode::Require.requires_tls() && !SslMode::Prefer.requires_tls());
        assert!(SslMode::Prefer.asks_tls() && !SslMode::Allow.asks_tls());
    }

    #[test]
    fn tls_words_are_split_off_either_form() {
        let (rest, tls) =
            split_tls("host=db dbname='my \\'db' sslmode=verify-ca sslrootcert=ca.pem").unwrap();
        assert_eq!(rest, "host='db' dbname='my \\'db'");
        assert_eq!(tls.mode, SslMode::VerifyCa);
        let (rest, tls) = split_tls(
            "postgresql://u@db:5432/app?sslmode=verify-full&sslrootcert=%2Ftmp%2Fca.pem&connect_timeout=3",
        )
        .unwrap();
        assert_eq!(rest, "postgresql://u@db:5432/app?connect_timeout=3");
        assert_eq!(tls.rootcert, Some(PathBuf::from("/tmp/ca.pem")));
        let (rest, tls) = split_tls("postgresql://db/app?sslmode=disable").unwrap();
        assert_eq!(
            (rest.as_str(), tls.mode),
            ("postgresql://db/app", SslMode::Disable)
        );
        assert!(split_tls("postgresql://db/app?sslrootcert=%zz")
            .unwrap_err()
            .contains("percent"));
    }
}
