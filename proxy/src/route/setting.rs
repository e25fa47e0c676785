//! The statements that change the session's organization (`SET lokadb.org`, `RESET`,
//! `DISCARD ALL`), which the proxy follows to limit the session's statements to it
//! ([`super::scope`]), and those that may change its transaction defaults
//! ([`may_change_transaction_defaults`]). Pure: SQL text in, a [`Setting`] out.
//!
//! The proxy follows only the forms whose effect it knows when it sends them: `SET` or
//! `RESET` of `lokadb.org` as a query of its own. `SET LOCAL`, `set_config()` and a `SET`
//! among other statements end, or may not happen, with a transaction the proxy does not
//! see the end of; they are refused rather than followed wrongly.

use super::analysis::{find, mentions};
use sqlparser::ast::{
    ContextModifier, DiscardObject, Expr, ObjectName, Reset, Set, Statement, Value,
};

/// The setting's name, as Postgres knows it (any case).
pub const NAME: &str = "lokadb.org";

/// What a statement does to the session's organization.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Setting {
    /// `SET [SESSION] lokadb.org = v` (`TO v`): the organization `v`; `None` for an empty
    /// value (no organization).
    To(Option<String>),
    /// `RESET lokadb.org`, `SET lokadb.org TO DEFAULT`: back to the session's default, the
    /// value of the connection's startup `options` ([`from_options`]), if any.
    Default,
    /// `RESET ALL` or `DISCARD ALL`: every setting back to its default; `alone` when it is
    /// the query's only statement.
    ResetAll { alone: bool },
    /// A form the proxy does not follow, named for the client's error.
    Refused(&'static str),
}

/// What `sql` does to the session's organization, if anything. Costs a scan of the text;
/// only a statement that names the setting, or begins with SET, RESET or DISCARD, is parsed.
/// `thorough`: also find a RESET ALL or DISCARD ALL after other statements (a longer scan,
/// for sessions with an organization set).
pub fn setting(sql: &str, thorough: bool) -> Option<Setting> {
    let names_it = mentions(sql, NAME.as_bytes());
    let first = first_word(sql);
    // A SET may quote the name (`"lokadb"."org"`); SETs are rare enough to parse.
    let resets = thorough && (mentions(sql, b"reset") || mentions(sql, b"discard"));
    if !names_it
        && !resets
        && !["set", "reset", "discard"]
            .iter()
            .any(|w| first.eq_ignore_ascii_case(w))
    {
        return None;
    }
    let Ok(statements) = super::analysis::parse(sql) else {
        return (names_it
            && (first.eq_ignore_ascii_case("set") || first.eq_ignore_ascii_case("reset")))
        .then_some(Setting::Refused(
            "a SET lokadb.org the proxy could not read",
        ));
    };
    let mut found = None;
    for s in &statements {
        let this = match s {
            Statement::Set(Set::SingleAssignment {
                scope,
                variable,
                values,
                ..
            }) if is_setting(variable) => match (scope, values.as_slice()) {
                (Some(ContextModifier::Local), _) => Setting::Refused("SET LOCAL lokadb.org"),
                (_, [v]) => match value(v) {
                    Some(SetValue::Default) => Setting::Default,
                    Some(SetValue::Text(v)) => Setting::To(Some(v).filter(|v| !v.is_empty())),
                    None => Setting::Refused("a value of lokadb.org that is not a constant"),
                },
                _ => Setting::Refused("a SET lokadb.org of several values"),
            },
            Statement::Reset(r) => match &r.reset {
                Reset::ConfigurationParameter(name) if is_setting(name) => Setting::Default,
                Reset::ALL => Setting::ResetAll {
                    alone: statements.len() == 1,
                },
                _ => continue,
            },
            Statement::Discard {
                object_type: DiscardObject::ALL,
            } => Setting::ResetAll {
                alone: statements.len() == 1,
            },
            _ => continue,
        };
        if let Setting::ResetAll { .. } = this {
            found.get_or_insert(this);
            continue;
        }
        if statements.len() > 1 {
            return Some(Setting::Refused(
                "a change of lokadb.org among other statements",
            ));
        }
        found = Some(this);
    }
    if found.is_none() && names_it && mentions(sql, b"set_config") {
        return Some(Setting::Refused("set_config('lokadb.org', …)"));
    }
    found
}

/// The statement's first word (after whitespace; a comment first makes it no word).
fn first_word(sql: &str) -> &str {
    let s = sql.trim_start();
    let end = s
        .find(|c: char| !c.is_ascii_alphabetic())
        .unwrap_or(s.len());
    &s[..end]
}

fn is_setting(name: &ObjectName) -> bool {
    name.to_string().replace('"', "").eq_ignore_ascii_case(NAME)
}

/// A SET value as Postgres reads it.
enum SetValue {
    /// A string, a number, or a word.
    Text(String),
    /// `DEFAULT`.
    Default,
}

fn value(e: &Expr) -> Option<SetValue> {
    match e {
        Expr::Value(v) => match &v.value {
            Value::SingleQuotedString(s) | Value::Number(s, _) => Some(SetValue::Text(s.clone())),
            _ => None,
        },
        Expr::Identifier(i)
            if i.quote_style.is_none() && i.value.eq_ignore_ascii_case("default") =>
        {
            Some(SetValue::Default)
        }
        Expr::Identifier(i) if i.quote_style.is_none() => {
            Some(SetValue::Text(i.value.to_lowercase()))
        }
        Expr::Identifier(i) => Some(SetValue::Text(i.value.clone())),
        Expr::UnaryOp {
            op: sqlparser::ast::UnaryOperator::Minus,
            expr,
        } => match value(expr)? {
            SetValue::Text(v) => Some(SetValue::Text(format!("-{v}"))),
            SetValue::Default => None,
        },
        _ => None,
    }
}

/// Whether `sql` may change the session's transaction defaults
/// (`default_transaction_isolation`, `…_read_only`, `…_deferrable`), which the proxy knows
/// only as they were at login: it names one (`SET`, `RESET`, `set_config`, but also a read
/// of one), sets `SESSION CHARACTERISTICS`, calls `set_config` with a name that is not a
/// plain string literal free of `transaction`, or writes a name with Unicode escapes
/// (`U&"…"`). A scan of the text, no parse, so a comment or a string counts too: a false
/// alarm costs the session its deferred BEGIN, nothing else. `RESET ALL` and `DISCARD ALL`
/// return the defaults to their values at login: nothing to follow. Not seen: a function
/// that sets them (a user's, a `DO` block's `EXECUTE`).
pub fn may_change_transaction_defaults(sql: &str) -> bool {
    mentions(sql, b"default_transaction_")
        || mentions(sql, b"characteristics")
        || mentions(sql, b"u&\"")
        || set_config_unfollowed(sql)
}

/// Some `set_config(` in `sql` names its setting other than by a plain literal (`'…'` alone,
/// no quote or backslash inside) free of `transaction`.
fn set_config_unfollowed(sql: &str) -> bool {
    const CALL: &[u8] = b"set_config";
    let mut rest = sql;
    while let Some(at) = find(rest, CALL) {
        rest = &rest[at + CALL.len()..];
        let Some(args) = rest.trim_start().strip_prefix('(') else {
            // Another word that begins so (`set_config_x`), or a call the scan cannot read.
            return true;
        };
        let Some(literal) = args.trim_start().strip_prefix('\'') else {
            return true;
        };
        let Some(end) = literal.find('\'') else {
            return true;
        };
        let (name, after) = (&literal[..end], &literal[end + 1..]);
        // The name is the literal alone (not `'a' || …`, not `'it''s'`).
        if !after.trim_start().starts_with(',')
            || name.contains('\\')
            || mentions(name, b"transaction")
        {
            return true;
        }
        rest = after;
    }
    false
}

/// The organization a connection's startup `options` set (`-c lokadb.org=v`,
/// `-clokadb.org=v`, `--lokadb.org=v`; libpq's `PGOPTIONS`), read as the server reads them:
/// arguments split at unescaped whitespace, `\` escaping the next character, the last
/// setting winning. `Some(None)`: set to the empty value (no organization); `None`: not set.
pub fn from_options(options: &str) -> Option<Option<String>> {
    let mut args = Vec::new();
    let mut arg = String::new();
    let mut chars = options.chars();
    let mut in_arg = false;
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(n) = chars.next() {
                    arg.push(n);
                }
                in_arg = true;
            }
            c if c.is_ascii_whitespace() => {
                if in_arg {
                    args.push(std::mem::take(&mut arg));
                    in_arg = false;
                }
            }
            c => {
                arg.push(c);
                in_arg = true;
            }
        }
    }
    if in_arg {
        args.push(arg);
    }
    let mut found = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let assignment = if a == "-c" {
            it.next().map(String::as_str)
        } else if let Some(rest) = a.strip_prefix("-c") {
            Some(rest)
        } else {
            a.strip_prefix("--")
        };
        let Some((name, v)) = assignment.and_then(|x| x.split_once('=')) else {
            continue;
        };
        // The server reads `--name` with dashes as underscores, and any case.
        if name.replace('-', "_").eq_ignore_ascii_case(NAME) {
            found = Some(Some(v.to_owned()).filter(|v| !v.is_empty()));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_forms_the_proxy_follows() {
        let to = |v: &str| Some(Setting::To(Some(v.to_owned())));
        assert_eq!(setting("SET lokadb.org = 42", true), to("42"));
        assert_eq!(setting("set LokaDB.Org to '42';", true), to("42"));
        assert_eq!(setting("SET SESSION lokadb.org = acme", true), to("acme"));
        assert_eq!(setting("SET \"lokadb\".\"org\" = 'Acme'", true), to("Acme"));
        assert_eq!(
            setting("SET lokadb.org TO DEFAULT", true),
            Some(Setting::Default)
        );
        assert_eq!(
            setting("SET lokadb.org = ''", true),
            Some(Setting::To(None))
        );
        assert_eq!(setting("RESET lokadb.org", true), Some(Setting::Default));
        assert_eq!(
            setting("RESET ALL", true),
            Some(Setting::ResetAll { alone: true })
        );
        assert_eq!(
            setting("discard all", true),
            Some(Setting::ResetAll { alone: true })
        );
        assert_eq!(
            setting("SELECT 1; RESET ALL", true),
            Some(Setting::ResetAll { alone: false })
        );
    }

    #[test]
    fn the_startup_options_as_the_server_reads_them() {
        let org = |v: &str| Some(Some(v.to_owned()));
        assert_eq!(from_options("-c lokadb.org=42"), org("42"));
        assert_eq!(from_options("-clokadb.org=42"), org("42"));
        assert_eq!(from_options("--lokadb.org=acme"), org("acme"));
        assert_eq!(from_options("  -c  LokaDB.Org=7  "), org("7"));
        assert_eq!(
            from_options("-c search_path=a,b -c lokadb.org=1 -c lokadb.org=2"),
            org("2")
        );
        assert_eq!(from_options(r"-c lokadb.org=two\ words"), org("two words"));
        assert_eq!(from_options(r"-c lokadb.org=a\\b"), org(r"a\b"));
        assert_eq!(from_options("-c lokadb.org="), Some(None));
        for none in [
            "",
            "-c search_path=public",
            "-c lokadb.org",
            "-c",
            "lokadb.org=1",
            "-c lokadb.organization=1",
            r"-c\ lokadb.org=1",
        ] {
            assert_eq!(from_options(none), None, "{none}");
        }
    }

    #[test]
    fn the_forms_it_refuses_and_the_statements_it_ignores() {
        for sql in [
            "SET LOCAL lokadb.org = 42",
            "SET lokadb.org = 42; SELECT 1",
            "SELECT set_config('lokadb.org', '42', false)",
            "SET lokadb.org = 1, 2",
        ] {
            assert!(
                matches!(setting(sql, false), Some(Setting::Refused(_))),
                "{sql}"
            );
        }
        for sql in [
            "SELECT * FROM lokadb.org",
            "SET search_path = public",
            "RESET search_path",
            "DISCARD PLANS",
            "SELECT current_setting('lokadb.org')",
            "SHOW lokadb.org",
            "SELECT 1",
        ] {
            assert_eq!(setting(sql, true), None, "{sql}");
        }
    }

    #[test]
    fn what_may_change_the_transaction_defaults() {
        for sql in [
            "SET default_transaction_isolation = 'serializable'",
            "set SESSION Default_Transaction_Read_Only to on",
            "RESET default_transaction_deferrable",
            "SET \"default_transaction_isolation\" TO 'repeatable read'",
            "/* first */ SELECT 1; SET default_transaction_isolation = 'serializable'",
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE",
            "SELECT set_config('default_transaction_isolation', 'serializable', false)",
            "SELECT pg_catalog.set_config ( 'default_transaction_read_only', 'on', false)",
            "SELECT set_config('app.x', '1', false), set_config($1, $2, false)",
            "SELECT set_config('default_' || 'transaction_isolation', 'serializable', false)",
            "SELECT set_config(E'default\\_transaction_isolation', 'serializable', false)",
            "SELECT set_config('it''s', '1', false)",
            "SELECT set_config(name, 'on', false) FROM t",
            "SET U&\"default\\005ftransaction_isolation\" = 'serializable'",
        ] {
            assert!(may_change_transaction_defaults(sql), "{sql}");
        }
        for sql in [
            "SELECT 1",
            "BEGIN",
            "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE",
            "SET search_path = public",
            "SELECT set_config('app.tenant', $1, true)",
            "select set_config('lokadb.statement_org', '', true); select 1",
            "RESET ALL",
            "DISCARD ALL",
            "SELECT current_setting('transaction_isolation')",
        ] {
            assert!(!may_change_transaction_defaults(sql), "{sql}");
        }
    }
}
