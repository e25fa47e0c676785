//! An organization's id as the proxy carries it.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::rc::Rc;

/// An organization's id: the text of its organization column's value (an integer's or a
/// uuid's text form too), as `lokadb.org` and the metadata name it. Cheap to clone: a
/// session holds the same few in several places.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OrgId(Rc<str>);

impl OrgId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Deref for OrgId {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for OrgId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl From<&str> for OrgId {
    fn from(id: &str) -> OrgId {
        OrgId(Rc::from(id))
    }
}

impl From<String> for OrgId {
    fn from(id: String) -> OrgId {
        OrgId(Rc::from(id))
    }
}

impl fmt::Display for OrgId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
