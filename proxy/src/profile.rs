//! An organization's profile once moved: how the proxy reaches its rows. Spelled as in
//! `lokadb.org.profile` and on the command line (`--profile`).

use std::fmt;

/// `fdw` or `fdw+direct`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Profile {
    /// Through the cloud only (postgres_fdw).
    #[value(name = "fdw")]
    Fdw,
    /// Also straight from the proxy to the organization's database (the direct path).
    #[value(name = "fdw+direct")]
    FdwDirect,
}

impl Profile {
    /// The spelling in the catalog and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Profile::Fdw => "fdw",
            Profile::FdwDirect => "fdw+direct",
        }
    }

    /// Reads the catalog's spelling; `None` for anything else.
    pub fn parse(s: &str) -> Option<Profile> {
        match s {
            "fdw" => Some(Profile::Fdw),
            "fdw+direct" => Some(Profile::FdwDirect),
            _ => None,
        }
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_read_back() {
        for p in [Profile::Fdw, Profile::FdwDirect] {
            assert_eq!(Profile::parse(p.as_str()), Some(p));
            let clap = <Profile as clap::ValueEnum>::from_str(p.as_str(), false);
            assert_eq!(clap, Ok(p));
        }
        assert_eq!(Profile::parse("direct"), None);
    }
}
