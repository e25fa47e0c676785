//! SCRAM-SHA-256 with the client, against the verifier the cloud keeps for its role.

use crate::backend::auth_query::UserSecret;
use crate::core::{Core, Database};
use crate::error::SessionError;
use crate::net::stream::{send, ClientStream};
use crate::scram::{Credentials, ServerExchange, Verifier, MECHANISM};
use futures_lite::AsyncReadExt;
use lokadb_shared::wire::fields::Fields;
use lokadb_shared::wire::tags::*;
use lokadb_shared::wire::{backend, Header};

/// SASL messages are small; Postgres caps password packets similarly.
const MAX_AUTH_MESSAGE: u32 = 8192;

/// A client that proved its password: what the proxy logs in to the cloud with, and
/// the server-final-message to send once the cloud accepted that login.
pub struct Authenticated {
    /// Passthrough keys, or the password from `users_file`.
    pub credentials: Credentials,
    /// `AuthenticationSASLFinal` data.
    pub server_final: String,
}

/// Authenticates `user` for `db`.
///
/// # Errors
///
/// [`SessionError::AuthFailed`] for a wrong password or unknown role (indistinguishable
/// to the client), protocol errors, or a failed verifier lookup.
pub async fn authenticate(
    stream: &mut ClientStream,
    core: &Core,
    db: &Database,
    user: &str,
) -> Result<Authenticated, SessionError> {
    let secret = lookup(core, db, user).await?;
    let verifier = match &secret {
        Some(s) => s.verifier.clone(),
        None => Verifier::mock(user, &core.shared.mock_secret),
    };

    let mut out = Vec::new();
    backend::auth_sasl(&mut out, &[MECHANISM]);
    send(stream, &out).await.map_err(SessionError::Client)?;

    let initial = read_password_message(stream).await?;
    let mut f = Fields::new(&initial, "SASLInitialResponse");
    let mechanism = f.cstr()?;
    if mechanism != MECHANISM {
        return Err(SessionError::Scram(crate::scram::ScramError::Unsupported(
            "SASL mechanism",
        )));
    }
    let len = f.i32()?;
    let data = if len < 0 {
        &[][..]
    } else {
        f.take(len as usize)?
    };
    let (exchange, server_first) =
        ServerExchange::start(data, &verifier).map_err(SessionError::Scram)?;

    out.clear();
    backend::auth_sasl_data(&mut out, AUTH_SASL_CONTINUE, server_first.as_bytes());
    send(stream, &out).await.map_err(SessionError::Client)?;

    let response = read_password_message(stream).await?;
    let (keys, server_final) = exchange.finish(&response, &verifier).map_err(|e| match e {
        crate::scram::ScramError::BadProof => SessionError::AuthFailed {
            user: user.to_owned(),
        },
        other => SessionError::Scram(other),
    })?;
    let Some(secret) = secret else {
        return Err(SessionError::AuthFailed {
            user: user.to_owned(),
        });
    };
    let credentials = match secret.password {
        Some(p) => Credentials::Password(p),
        None => Credentials::Keys(keys),
    };
    Ok(Authenticated {
        credentials,
        server_final,
    })
}

async fn lookup(
    core: &Core,
    db: &Database,
    user: &str,
) -> Result<Option<UserSecret>, SessionError> {
    if let Some(query) = core.auth_query(&db.name) {
        return query
            .lookup(user)
            .await
            .map_err(|e| SessionError::AuthLookup(e.to_string()));
    }
    Ok(core
        .shared
        .settings()
        .users
        .as_ref()
        .and_then(|u| u.0.get(user).cloned()))
}

async fn read_password_message(stream: &mut ClientStream) -> Result<Vec<u8>, SessionError> {
    let mut head = [0u8; 5];
    stream
        .read_exact(&mut head)
        .await
        .map_err(SessionError::Client)?;
    let h = Header::peek(&head, MAX_AUTH_MESSAGE)?.expect("five bytes were read");
    if h.tag != FE_PASSWORD {
        return Err(SessionError::UnexpectedMessage {
            expected: "a SASL response",
            got: h.tag,
        });
    }
    let mut body = vec![0u8; h.body_len()];
    stream
        .read_exact(&mut body)
        .await
        .map_err(SessionError::Client)?;
    Ok(body)
}
