//! Text helpers shared by both binaries.

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
pub fn prefix(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::prefix;

    #[test]
    fn a_prefix_never_cuts_a_character() {
        assert_eq!(prefix("abc", 5), "abc");
        assert_eq!(prefix("abc", 2), "ab");
        // 'é' is two bytes: a cut inside it goes back before it.
        assert_eq!(prefix("aé", 2), "a");
        assert_eq!(prefix("aé", 3), "aé");
        assert_eq!(prefix("", 0), "");
    }
}
