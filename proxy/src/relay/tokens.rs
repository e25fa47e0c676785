//! Agent tokens: `ORG.SECRET`, stored by the relay as the SHA-256 of the whole token.
//!
//! A token is 32 random bytes (base64url) after the organization id, so a plain hash
//! is enough (there is nothing to brute-force, unlike a password); the relay never
//! holds a token, only its hash, and compares hashes in constant time.

use base64::Engine as _;
use sha2::{Digest, Sha256};
use std::collections::HashMap;

/// The organization ids the relay knows, with their token hashes.
pub struct Tokens(HashMap<String, [u8; 32]>);

/// Why a token was refused (logged; the agent only learns "not valid").
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Not `ORG.SECRET`.
    #[error("the token is not of the form ORG.SECRET")]
    Malformed,
    /// No token is configured for the organization.
    #[error("organization {0:?} is not in relay.tokens")]
    UnknownOrg(String),
    /// The hash differs.
    #[error("wrong token for organization {0:?}")]
    Wrong(String),
}

impl Tokens {
    /// From the config's `relay.tokens` (already validated).
    pub fn new(config: &std::collections::BTreeMap<String, String>) -> Tokens {
        Tokens(
            config
                .iter()
                .map(|(org, hash)| {
                    let h = lokadb_shared::config::parse_token_hash(hash)
                        .expect("validated with the config");
                    (org.clone(), h)
                })
                .collect(),
        )
    }

    /// Whether `org` has the same token hash here as in `other` (and has one).
    pub fn same_for(&self, other: &Tokens, org: &str) -> bool {
        matches!((self.0.get(org), other.0.get(org)), (Some(a), Some(b)) if a == b)
    }

    /// Whether the organization is known (has a token).
    pub fn knows(&self, org: &str) -> bool {
        self.0.contains_key(org)
    }

    /// Checks `token` and returns its organization.
    ///
    /// # Errors
    ///
    /// [`TokenError`]; the time taken does not depend on how much of the hash matched.
    pub fn verify(&self, token: &str) -> Result<String, TokenError> {
        let (org, _secret) = token.rsplit_once('.').ok_or(TokenError::Malformed)?;
        let digest = hash(token);
        let expected = self
            .0
            .get(org)
            .ok_or_else(|| TokenError::UnknownOrg(org.to_owned()))?;
        if constant_time_eq(&digest, expected) {
            Ok(org.to_owned())
        } else {
            Err(TokenError::Wrong(org.to_owned()))
        }
    }
}

/// SHA-256 of the token.
pub fn hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// The config form of a token hash.
pub fn hash_text(token: &str) -> String {
    let mut s = String::from("sha256:");
    for b in hash(token) {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// A new random token for `org`.
pub fn generate(org: &str) -> String {
    let secret: [u8; 32] = rand::random();
    format!(
        "{org}.{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(secret)
    )
}

fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    // No early exit: every byte is compared.
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(pairs: &[(&str, &str)]) -> Tokens {
        Tokens::new(
            &pairs
                .iter()
                .map(|(o, t)| ((*o).to_owned(), hash_text(t)))
                .collect(),
        )
    }

    #[test]
    fn a_generated_token_verifies_for_its_organization_only() {
        let acme = generate("acme");
        let globex = generate("globex");
        let t = tokens(&[("acme", &acme), ("globex", &globex)]);
        assert_eq!(t.verify(&acme), Ok("acme".to_owned()));
        assert_eq!(t.verify(&globex), Ok("globex".to_owned()));
        // Globex's secret under acme's name.
        let forged = format!("acme.{}", globex.rsplit_once('.').unwrap().1);
        assert_eq!(t.verify(&forged), Err(TokenError::Wrong("acme".into())));
        assert_eq!(
            t.verify("initech.x"),
            Err(TokenError::UnknownOrg("initech".into()))
        );
        assert_eq!(t.verify("no-dot"), Err(TokenError::Malformed));
    }

    #[test]
    fn organization_ids_may_contain_dots() {
        let tok = generate("eu.acme");
        let t = tokens(&[("eu.acme", &tok)]);
        assert_eq!(t.verify(&tok), Ok("eu.acme".to_owned()));
        assert!(hash_text(&tok).starts_with("sha256:"));
        assert_eq!(hash_text(&tok).len(), 7 + 64);
    }
}
