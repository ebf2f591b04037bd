//! Statements whose values are bound in the order of their text: SQLite binds anonymous
//! `?`s in order across all the statements of one call without looking a name up, so a
//! batch's writes go to the one writer's thread as a single call. (Postgres takes arrays
//! instead: its batch statements keep one text whatever their size.)

use super::page::Arg;

/// The values of one or more SQLite statements, each placeholder used once.
#[derive(Default)]
pub struct Sql {
    pub args: Vec<Arg>,
}

impl Sql {
    /// Records a value; answers its placeholder, to be used once, after those before it.
    pub fn arg(&mut self, a: Arg) -> String {
        self.args.push(a);
        "?".to_string()
    }

    pub fn text(&mut self, s: impl std::fmt::Display) -> String {
        self.arg(Arg::Text(s.to_string()))
    }

    pub fn int(&mut self, i: i64) -> String {
        self.arg(Arg::Int(i))
    }

    /// A comma-separated list of placeholders, one per item.
    pub fn list<T: std::fmt::Display>(&mut self, items: &[T]) -> String {
        items
            .iter()
            .map(|i| self.text(i))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `VALUES (…), (…)` rows, each from `row`, which binds its own values.
    pub fn rows<T>(&mut self, items: &[T], mut row: impl FnMut(&mut Sql, &T) -> String) -> String {
        let rows: Vec<String> = items
            .iter()
            .map(|i| format!("({})", row(self, i)))
            .collect();
        rows.join(", ")
    }
}

/// `items` with its last one repeated up to the next power of two: a statement's text
/// then takes one of a few lengths, and the connection's cache of prepared statements
/// keeps them, where a text per count was prepared anew and pushed the others out. A
/// value twice in an `IN` list, or a row written twice with the same values, changes
/// nothing.
pub fn padded<T: Clone>(items: &[T]) -> Vec<T> {
    let mut v = items.to_vec();
    if let Some(last) = items.last() {
        v.resize(items.len().next_power_of_two(), last.clone());
    }
    v
}

#[cfg(test)]
mod tests {
    use super::padded;

    #[test]
    fn lists_are_padded_to_a_power_of_two_with_their_last_item() {
        assert_eq!(padded::<u8>(&[]), Vec::<u8>::new());
        assert_eq!(padded(&[1]), vec![1]);
        assert_eq!(padded(&[1, 2, 3]), vec![1, 2, 3, 3]);
        assert_eq!(padded(&[1, 2, 3, 4, 5]), vec![1, 2, 3, 4, 5, 5, 5, 5]);
        assert_eq!(padded(&[1, 2, 3, 4]), vec![1, 2, 3, 4]);
    }
}
