// `sqlx::migrate!` embeds the migrations when the crate compiles: without this, a new or
// edited migration alone would leave an incremental build with the old ones.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
