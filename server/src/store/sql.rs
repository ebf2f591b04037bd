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
