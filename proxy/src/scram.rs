//! SCRAM-SHA-256 (RFC 5802, RFC 7677) as Postgres uses it, on both sides of the proxy.
//!
//! Clients authenticate against the verifier the cloud stores for their role. Their
//! proof yields `ClientKey` (`proof XOR HMAC(StoredKey, AuthMessage)`); with it and the
//! verifier's `ServerKey` the proxy can log in to the cloud as that role without ever
//! knowing the password — SCRAM passthrough, as PgBouncer does.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::fmt;

/// The only mechanism offered: channel binding (`-PLUS`) is not, because the proxy's
/// TLS session is not the cloud's.
pub const MECHANISM: &str = "SCRAM-SHA-256";

const NONCE_LEN: usize = 18;

/// Why a SCRAM exchange failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScramError {
    /// A message does not follow RFC 5802's grammar.
    Malformed(&'static str),
    /// The client asked for something we do not offer (channel binding, authzid).
    Unsupported(&'static str),
    /// The proof does not match: wrong password.
    BadProof,
    /// The server's signature does not match: the cloud does not hold this verifier.
    BadServerSignature,
    /// The server asks for more PBKDF2 iterations than [`MAX_SERVER_ITERATIONS`].
    TooManyIterations(u32),
}

impl fmt::Display for ScramError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScramError::Malformed(what) => write!(f, "malformed SCRAM message: {what}"),
            ScramError::Unsupported(what) => write!(f, "unsupported SCRAM option: {what}"),
            ScramError::BadProof => f.write_str("SCRAM proof does not match"),
            ScramError::BadServerSignature => f.write_str("SCRAM server signature does not match"),
            ScramError::TooManyIterations(n) => write!(
                f,
                "the server asks for {n} SCRAM iterations, more than the {MAX_SERVER_ITERATIONS} \
                 LokaDB computes (set the role's password again with a lower scram_iterations)"
            ),
        }
    }
}

impl std::error::Error for ScramError {}

/// The keys that let the proxy act as a role towards the cloud.
#[derive(Clone, PartialEq, Eq)]
pub struct ScramKeys {
    /// `ClientKey = HMAC(SaltedPassword, "Client Key")`.
    pub client_key: [u8; 32],
    /// `ServerKey = HMAC(SaltedPassword, "Server Key")`.
    pub server_key: [u8; 32],
}

impl fmt::Debug for ScramKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ScramKeys(..)") // secrets never reach logs
    }
}

impl ScramKeys {
    /// Derives the keys from a password, salt and iteration count.
    pub fn from_password(password: &str, salt: &[u8], iterations: u32) -> ScramKeys {
        // Postgres applies SASLprep and falls back to the raw bytes when it fails.
        let prepared = stringprep::saslprep(password)
            .map(|p| p.into_owned())
            .unwrap_or_else(|_| password.to_owned());
        let mut salted = [0u8; 32];
        pbkdf2::pbkdf2_hmac::<Sha256>(prepared.as_bytes(), salt, iterations, &mut salted);
        ScramKeys {
            client_key: hmac(&salted, b"Client Key"),
            server_key: hmac(&salted, b"Server Key"),
        }
    }
}

/// A stored SCRAM verifier: `SCRAM-SHA-256$<iter>:<salt>$<StoredKey>:<ServerKey>`.
#[derive(Clone, PartialEq, Eq)]
pub struct Verifier {
    /// PBKDF2 iterations.
    pub iterations: u32,
    /// Salt (raw bytes).
    pub salt: Vec<u8>,
    /// `StoredKey = H(ClientKey)`.
    pub stored_key: [u8; 32],
    /// `ServerKey`.
    pub server_key: [u8; 32],
}

impl fmt::Debug for Verifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Verifier(iterations={})", self.iterations)
    }
}

impl Verifier {
    /// Parses the text form Postgres keeps in `pg_authid.rolpassword`.
    ///
    /// # Errors
    ///
    /// [`ScramError::Malformed`] for anything else (an md5 hash, a plain password).
    pub fn parse(s: &str) -> Result<Verifier, ScramError> {
        let bad = ScramError::Malformed("verifier");
        let rest = s.strip_prefix("SCRAM-SHA-256$").ok_or(bad.clone())?;
        let (iter_salt, keys) = rest.split_once('$').ok_or(bad.clone())?;
        let (iter, salt) = iter_salt.split_once(':').ok_or(bad.clone())?;
        let (stored, server) = keys.split_once(':').ok_or(bad.clone())?;
        let key = |k: &str| -> Result<[u8; 32], ScramError> {
            B64.decode(k)
                .ok()
                .and_then(|v| v.try_into().ok())
                .ok_or(bad.clone())
        };
        Ok(Verifier {
            iterations: iter.parse().map_err(|_| bad.clone())?,
            salt: B64.decode(salt).map_err(|_| bad.clone())?,
            stored_key: key(stored)?,
            server_key: key(server)?,
        })
    }

    /// Builds a verifier from a password, as `CREATE ROLE … PASSWORD` would.
    pub fn from_password(password: &str, salt: Vec<u8>, iterations: u32) -> Verifier {
        let keys = ScramKeys::from_password(password, &salt, iterations);
        Verifier {
            iterations,
            salt,
            stored_key: sha256(&keys.client_key),
            server_key: keys.server_key,
        }
    }

    /// A verifier no password matches, for roles that do not exist: the exchange runs
    /// to the end and fails like a wrong password, so a client cannot probe role names.
    pub fn mock(role: &str, secret: &[u8; 32]) -> Verifier {
        let salt = hmac(secret, role.as_bytes())[..16].to_vec();
        Verifier {
            iterations: 4096,
            salt,
            stored_key: rand::random(),
            server_key: rand::random(),
        }
    }
}

/// Server side: the state between server-first and client-final.
pub struct ServerExchange {
    client_first_bare: String,
    server_first: String,
    gs2_header: String,
    nonce: String,
}

impl ServerExchange {
    /// Handles client-first-message and returns the exchange and server-first-message.
    ///
    /// # Errors
    ///
    /// [`ScramError::Malformed`] or [`ScramError::Unsupported`].
    pub fn start(
        client_first: &[u8],
        verifier: &Verifier,
    ) -> Result<(ServerExchange, String), ScramError> {
        let msg = std::str::from_utf8(client_first)
            .map_err(|_| ScramError::Malformed("client-first-message"))?;
        let (gs2_header, bare) = split_gs2(msg)?;
        let client_nonce = attr(bare, 'r').ok_or(ScramError::Malformed("client nonce"))?;
        if client_nonce.is_empty()
            || !client_nonce
                .bytes()
                .all(|b| b.is_ascii_graphic() && b != b',')
        {
            return Err(ScramError::Malformed("client nonce"));
        }
        let nonce = format!(
            "{client_nonce}{}",
            B64.encode(rand::random::<[u8; NONCE_LEN]>())
        );
        let server_first = format!(
            "r={nonce},s={},i={}",
            B64.encode(&verifier.salt),
            verifier.iterations
        );
        Ok((
            ServerExchange {
                client_first_bare: bare.to_owned(),
                server_first: server_first.clone(),
                gs2_header: gs2_header.to_owned(),
                nonce,
            },
            server_first,
        ))
    }

    /// Handles client-final-message: checks the proof against the verifier and returns
    /// the client's keys and server-final-message.
    ///
    /// # Errors
    ///
    /// [`ScramError::BadProof`] for a wrong password, [`ScramError::Malformed`] otherwise.
    pub fn finish(
        self,
        client_final: &[u8],
        verifier: &Verifier,
    ) -> Result<(ScramKeys, String), ScramError> {
        let msg = std::str::from_utf8(client_final)
            .map_err(|_| ScramError::Malformed("client-final-message"))?;
        let (without_proof, proof) = msg
            .rsplit_once(",p=")
            .ok_or(ScramError::Malformed("client proof"))?;
        let binding = attr(without_proof, 'c').ok_or(ScramError::Malformed("channel binding"))?;
        if B64.decode(binding).ok().as_deref() != Some(self.gs2_header.as_bytes()) {
            return Err(ScramError::Malformed(
                "channel binding does not match the gs2 header",
            ));
        }
        if attr(without_proof, 'r') != Some(self.nonce.as_str()) {
            return Err(ScramError::Malformed("nonce does not match"));
        }
        let proof: [u8; 32] = B64
            .decode(proof)
            .ok()
            .and_then(|p| p.try_into().ok())
            .ok_or(ScramError::Malformed("client proof"))?;
        let auth_message = format!(
            "{},{},{}",
            self.client_first_bare, self.server_first, without_proof
        );
        let signature = hmac(&verifier.stored_key, auth_message.as_bytes());
        let client_key = xor(&proof, &signature);
        if !constant_time_eq(&sha256(&client_key), &verifier.stored_key) {
            return Err(ScramError::BadProof);
        }
        let server_signature = hmac(&verifier.server_key, auth_message.as_bytes());
        Ok((
            ScramKeys {
                client_key,
                server_key: verifier.server_key,
            },
            format!("v={}", B64.encode(server_signature)),
        ))
    }
}

/// What the client side needs to log in: keys (passthrough) or a password (keys are
/// derived once the server has sent salt and iterations).
#[derive(Clone, Debug)]
pub enum Credentials {
    /// Keys recovered from the client's proof.
    Keys(ScramKeys),
    /// A password (the auth role, or plain entries of `users_file`).
    Password(Secret),
}

/// A password that never reaches a log.
#[derive(Clone)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// The most PBKDF2 iterations a server may ask the proxy to compute for a password login.
/// A server (an organization's database is not the proxy's to trust) asking for millions
/// would take a CPU for minutes per login: 100,000 cost about 40 ms, on a thread of their
/// own, once per salt and core (PostgreSQL's default is 4,096).
pub const MAX_SERVER_ITERATIONS: u32 = 100_000;

/// A server-first-message, read ([`ClientExchange::read_server_first`]).
#[derive(Debug)]
pub struct ServerFirst<'a> {
    msg: &'a str,
    nonce: &'a str,
    salt: Vec<u8>,
    iterations: u32,
}

/// SHA-256 of the password (the password itself is not kept as a key), salt, iterations.
type Derivation = ([u8; 32], Vec<u8>, u32);

thread_local! {
    /// Keys derived from a password, per core: a server keeps its salt, so each login after
    /// the first on a core costs no PBKDF2 at all.
    static DERIVED: std::cell::RefCell<std::collections::HashMap<Derivation, ScramKeys>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
}

/// Entries kept before the cache starts over (servers × logins of the proxy's own).
const DERIVED_KEPT: usize = 256;

fn remember(key: Derivation, keys: &ScramKeys) {
    DERIVED.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() >= DERIVED_KEPT {
            c.clear();
        }
        c.insert(key, keys.clone());
    });
}

/// What `creds` give for a server-first-message.
enum Known {
    /// Passthrough keys, or a password's derived on this core before.
    Keys(ScramKeys),
    /// A password's keys not derived on this core yet.
    Derive(Derivation, String),
}

impl Known {
    fn of(creds: &Credentials, first: &ServerFirst<'_>) -> Result<Known, ScramError> {
        let p = match creds {
            Credentials::Keys(k) => return Ok(Known::Keys(k.clone())),
            Credentials::Password(p) => p,
        };
        if first.iterations > MAX_SERVER_ITERATIONS {
            return Err(ScramError::TooManyIterations(first.iterations));
        }
        let key = (sha256(p.0.as_bytes()), first.salt.clone(), first.iterations);
        Ok(match DERIVED.with(|c| c.borrow().get(&key).cloned()) {
            Some(k) => Known::Keys(k),
            None => Known::Derive(key, p.0.clone()),
        })
    }
}

/// The keys `creds` answer `first` with. A password's keys not derived on this core yet are
/// derived on a thread of their own while the core serves its other sessions: PBKDF2 at
/// [`MAX_SERVER_ITERATIONS`] takes tens of milliseconds, and a server may change its salt
/// at every login.
///
/// # Errors
///
/// [`ScramError::TooManyIterations`] past [`MAX_SERVER_ITERATIONS`] for a password.
pub async fn keys(creds: &Credentials, first: &ServerFirst<'_>) -> Result<ScramKeys, ScramError> {
    let (key, password) = match Known::of(creds, first)? {
        Known::Keys(k) => return Ok(k),
        Known::Derive(key, password) => (key, std::sync::Arc::new(password)),
    };
    let (salt, iterations, shared) = (key.1.clone(), key.2, password.clone());
    let derived = crate::rt::off_core(move || ScramKeys::from_password(&shared, &salt, iterations))
        .await
        // No thread to be had: derived here (bounded by the cap all the same).
        .unwrap_or_else(|_| ScramKeys::from_password(&password, &key.1, key.2));
    remember(key, &derived);
    Ok(derived)
}

/// [`keys`] on the calling thread, for the tests (no core to keep free).
#[cfg(test)]
fn keys_here(creds: &Credentials, first: &ServerFirst<'_>) -> Result<ScramKeys, ScramError> {
    match Known::of(creds, first)? {
        Known::Keys(k) => Ok(k),
        Known::Derive(key, password) => {
            let derived = ScramKeys::from_password(&password, &key.1, key.2);
            remember(key, &derived);
            Ok(derived)
        }
    }
}

/// Client side of an exchange with the cloud.
pub struct ClientExchange {
    client_first_bare: String,
    nonce: String,
}

impl ClientExchange {
    /// Starts an exchange; returns the state and client-first-message.
    pub fn start() -> (ClientExchange, String) {
        let nonce = B64.encode(rand::random::<[u8; NONCE_LEN]>());
        // Postgres ignores the SCRAM user name and uses the startup packet's.
        let bare = format!("n=,r={nonce}");
        let first = format!("n,,{bare}");
        (
            ClientExchange {
                client_first_bare: bare,
                nonce,
            },
            first,
        )
    }

    /// Reads server-first-message: the server's nonce (which must extend ours), its salt
    /// and iteration count.
    ///
    /// # Errors
    ///
    /// [`ScramError::Malformed`] when the server's message is not valid.
    pub fn read_server_first<'a>(
        &self,
        server_first: &'a [u8],
    ) -> Result<ServerFirst<'a>, ScramError> {
        let msg = std::str::from_utf8(server_first)
            .map_err(|_| ScramError::Malformed("server-first-message"))?;
        let nonce = attr(msg, 'r').ok_or(ScramError::Malformed("server nonce"))?;
        if !nonce.starts_with(&self.nonce) || nonce.len() == self.nonce.len() {
            return Err(ScramError::Malformed("server nonce"));
        }
        let salt = attr(msg, 's')
            .and_then(|s| B64.decode(s).ok())
            .ok_or(ScramError::Malformed("salt"))?;
        let iterations: u32 = attr(msg, 'i')
            .and_then(|i| i.parse().ok())
            .filter(|&i| i > 0)
            .ok_or(ScramError::Malformed("iterations"))?;
        Ok(ServerFirst {
            msg,
            nonce,
            salt,
            iterations,
        })
    }

    /// Answers server-first-message with `keys` ([`keys`]): client-final-message, and what
    /// checks the server's final message.
    pub fn respond(self, first: &ServerFirst<'_>, keys: &ScramKeys) -> (String, [u8; 32]) {
        let without_proof = format!("c=biws,r={}", first.nonce);
        let auth_message = format!("{},{},{}", self.client_first_bare, first.msg, without_proof);
        let signature = hmac(&sha256(&keys.client_key), auth_message.as_bytes());
        let proof = xor(&keys.client_key, &signature);
        let expected_server_sig = hmac(&keys.server_key, auth_message.as_bytes());
        (
            format!("{without_proof},p={}", B64.encode(proof)),
            expected_server_sig,
        )
    }

    /// Checks server-final-message against the expected signature.
    ///
    /// # Errors
    ///
    /// [`ScramError::BadServerSignature`] when it does not match.
    pub fn verify_final(server_final: &[u8], expected: &[u8; 32]) -> Result<(), ScramError> {
        let msg = std::str::from_utf8(server_final)
            .map_err(|_| ScramError::Malformed("server-final-message"))?;
        let sig = attr(msg, 'v')
            .and_then(|v| B64.decode(v).ok())
            .ok_or(ScramError::BadServerSignature)?;
        if constant_time_eq(&sig, expected) {
            Ok(())
        } else {
            Err(ScramError::BadServerSignature)
        }
    }
}

/// Splits client-first-message into gs2-header (with its trailing comma) and the bare part.
fn split_gs2(msg: &str) -> Result<(&str, &str), ScramError> {
    let cb = msg.as_bytes().first().copied();
    match cb {
        Some(b'n') | Some(b'y') => {}
        Some(b'p') => return Err(ScramError::Unsupported("channel binding was not offered")),
        _ => return Err(ScramError::Malformed("gs2 header")),
    }
    let first_comma = msg.find(',').ok_or(ScramError::Malformed("gs2 header"))?;
    let rest = &msg[first_comma + 1..];
    let second_comma = rest.find(',').ok_or(ScramError::Malformed("gs2 header"))?;
    if second_comma != 0 {
        return Err(ScramError::Unsupported("authorization identity"));
    }
    let split = first_comma + 2;
    Ok((&msg[..split], &msg[split..]))
}

/// The value of attribute `name` in a comma-separated SCRAM message.
fn attr(msg: &str, name: char) -> Option<&str> {
    msg.split(',').find_map(|part| {
        let mut chars = part.chars();
        (chars.next() == Some(name) && chars.next() == Some('=')).then(|| &part[2..])
    })
}

fn hmac(key: &[u8], data: &[u8]) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC accepts any key length");
    mac.update(data);
    mac.finalize().into_bytes().into()
}

fn sha256(data: &[u8]) -> [u8; 32] {
    Sha256::digest(data).into()
}

fn xor(a: &[u8; 32], b: &[u8; 32]) -> [u8; 32] {
    std::array::from_fn(|i| a[i] ^ b[i])
}

/// Compares without an early exit, so timing does not tell how much matched.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs one whole exchange: `creds` on the client side against `verifier` on the
    /// server side. Returns the keys the server recovered, or the server's error.
    fn exchange(creds: &Credentials, verifier: &Verifier) -> Result<ScramKeys, ScramError> {
        let (client, first) = ClientExchange::start();
        let (server, server_first) = ServerExchange::start(first.as_bytes(), verifier)?;
        let first = client.read_server_first(server_first.as_bytes())?;
        let keys = keys_here(creds, &first)?;
        let (client_final, expect) = client.respond(&first, &keys);
        let (keys, server_final) = server.finish(client_final.as_bytes(), verifier)?;
        ClientExchange::verify_final(server_final.as_bytes(), &expect)?;
        Ok(keys)
    }

    fn password(p: &str) -> Credentials {
        Credentials::Password(Secret(p.into()))
    }

    /// The application authenticates to the proxy with its password; the proxy then
    /// authenticates to the cloud with the keys recovered from the proof.
    #[test]
    fn passthrough_round_trip() {
        let verifier = Verifier::from_password("secret", b"0123456789abcdef".to_vec(), 4096);
        let text = format!(
            "SCRAM-SHA-256${}:{}${}:{}",
            verifier.iterations,
            B64.encode(&verifier.salt),
            B64.encode(verifier.stored_key),
            B64.encode(verifier.server_key)
        );
        assert_eq!(Verifier::parse(&text).unwrap(), verifier);
        let keys = exchange(&password("secret"), &verifier).unwrap();
        assert_eq!(
            exchange(&Credentials::Keys(keys.clone()), &verifier).unwrap(),
            keys
        );
    }

    /// A server-first-message answering `first` with `iterations`.
    fn server_first(first: &str, iterations: &str) -> String {
        let nonce = first.rsplit("r=").next().unwrap();
        format!("r={nonce}server,s={},i={iterations}", B64.encode(b"salt"))
    }

    /// The keys `creds` give for `msg`, answering `client`'s first message.
    fn keys_for(
        client: &ClientExchange,
        msg: &str,
        creds: &Credentials,
    ) -> Result<ScramKeys, ScramError> {
        keys_here(creds, &client.read_server_first(msg.as_bytes())?)
    }

    #[test]
    fn a_servers_iteration_count_is_bounded() {
        let (client, first) = ClientExchange::start();
        let too_many = server_first(&first, "100001");
        assert_eq!(
            keys_for(&client, &too_many, &password("p")).err(),
            Some(ScramError::TooManyIterations(100_001))
        );
        for bad in ["0", "-1", "x"] {
            let (client, first) = ClientExchange::start();
            let msg = server_first(&first, bad);
            assert_eq!(
                keys_for(&client, &msg, &password("p")).err(),
                Some(ScramError::Malformed("iterations")),
                "i={bad}"
            );
        }
        // Passthrough keys need no derivation: any count.
        let keys = ScramKeys::from_password("p", b"salt", 4096);
        let (client, first) = ClientExchange::start();
        let msg = server_first(&first, "4000000");
        assert!(keys_for(&client, &msg, &Credentials::Keys(keys)).is_ok());
    }

    /// The keys for `password`, `salt` and `iterations`, as a login derives them.
    fn derived(password: &str, salt: &[u8], iterations: u32) -> ScramKeys {
        let first = ServerFirst {
            msg: "",
            nonce: "",
            salt: salt.to_vec(),
            iterations,
        };
        keys_here(&super::tests::password(password), &first).unwrap()
    }

    #[test]
    fn derived_keys_are_the_passwords_and_kept_per_salt() {
        let direct = ScramKeys::from_password("secret", b"salt-a", 4096);
        assert_eq!(derived("secret", b"salt-a", 4096), direct);
        assert_eq!(derived("secret", b"salt-a", 4096), direct, "from the cache");
        assert_ne!(derived("secret", b"salt-b", 4096), direct);
        assert_ne!(derived("other", b"salt-a", 4096), direct);
        assert_ne!(derived("secret", b"salt-a", 4097), direct);
    }

    /// On a core, a derivation runs on a thread of its own: the core's other tasks go on
    /// meanwhile (a timer firing every millisecond keeps ticking through it).
    #[test]
    fn a_derivation_leaves_the_core_free() {
        let ticks = crate::rt::block_on(async {
            let first = ServerFirst {
                msg: "",
                nonce: "",
                salt: b"salt-free".to_vec(),
                iterations: MAX_SERVER_ITERATIONS,
            };
            let done = std::rc::Rc::new(std::cell::Cell::new(false));
            let ticker = crate::rt::spawn({
                let done = done.clone();
                async move {
                    let mut ticks = 0u32;
                    while !done.get() {
                        crate::rt::sleep(std::time::Duration::from_millis(1)).await;
                        ticks += 1;
                    }
                    ticks
                }
            });
            let keys = keys(&password("secret"), &first).await.unwrap();
            done.set(true);
            assert_eq!(
                keys,
                ScramKeys::from_password("secret", b"salt-free", MAX_SERVER_ITERATIONS)
            );
            ticker.await
        });
        // 100,000 iterations take milliseconds at the least: the timer ticked meanwhile (on
        // the core's thread it could not have, not even once).
        assert!(ticks >= 1, "{ticks}");
    }

    #[test]
    fn wrong_password_is_bad_proof() {
        let verifier = Verifier::from_password("secret", b"salt".to_vec(), 4096);
        assert_eq!(
            exchange(&password("nope"), &verifier),
            Err(ScramError::BadProof)
        );
    }

    #[test]
    fn mock_verifier_rejects_every_password() {
        let verifier = Verifier::mock("ghost", &[7; 32]);
        assert_eq!(
            Verifier::mock("ghost", &[7; 32]).salt,
            verifier.salt,
            "stable salt per role"
        );
        assert_eq!(
            exchange(&password(""), &verifier),
            Err(ScramError::BadProof)
        );
    }

    #[test]
    fn channel_binding_and_authzid_are_refused() {
        let v = Verifier::mock("x", &[0; 32]);
        assert!(matches!(
            ServerExchange::start(b"p=tls-server-end-point,,n=,r=abc", &v),
            Err(ScramError::Unsupported(_))
        ));
        assert!(matches!(
            ServerExchange::start(b"n,a=bob,n=,r=abc", &v),
            Err(ScramError::Unsupported(_))
        ));
        assert!(matches!(
            ServerExchange::start(b"garbage", &v),
            Err(ScramError::Malformed(_))
        ));
        assert!(matches!(
            ServerExchange::start(b"n,,n=,r=", &v),
            Err(ScramError::Malformed(_))
        ));
    }

    #[test]
    fn md5_and_plain_are_not_verifiers() {
        assert!(Verifier::parse("md5abcdef").is_err());
        assert!(Verifier::parse("SCRAM-SHA-256$x:salt$a:b").is_err());
    }
}
