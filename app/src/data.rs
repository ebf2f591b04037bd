//! A page's data: resources loaded through server functions, rendered on the server,
//! carried to the browser in the page and refreshed there while the page is open.

use crate::error::PortalResult;
use leptos::prelude::*;
use leptos::server::codee::{Decoder, Encoder};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::future::Future;

/// JSON, decoded from bytes: the way server functions decode their answers. Leptos's
/// own resource codec decodes from `&str`, which makes the browser bundle carry a second
/// copy of every type's decoder (serde_json compiles one per reader); sharing the
/// reader keeps one.
pub struct Json;

impl<T: Serialize> Encoder<T> for Json {
    type Error = serde_json::Error;
    type Encoded = String;

    fn encode(val: &T) -> Result<String, serde_json::Error> {
        serde_json::to_string(val)
    }
}

impl<T: DeserializeOwned> Decoder<T> for Json {
    type Error = serde_json::Error;
    type Encoded = str;

    fn decode(val: &str) -> Result<T, serde_json::Error> {
        serde_json::from_slice(val.as_bytes())
    }
}

/// What a page loads: its data, or why not.
pub type Data<T> = Resource<PortalResult<T>, Json>;

/// Loads `fetcher(source())`, again whenever `source` changes.
#[track_caller]
pub fn load<S, T, Fut>(
    source: impl Fn() -> S + Send + Sync + 'static,
    fetcher: impl Fn(S) -> Fut + Send + Sync + 'static,
) -> Data<T>
where
    S: Clone + PartialEq + Send + Sync + 'static,
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
    Fut: Future<Output = PortalResult<T>> + Send + 'static,
{
    Resource::new_with_options(source, fetcher, false)
}

/// Reloads `data` every `ms` milliseconds while the page is open in a browser with
/// JavaScript; the server render is not affected.
pub fn poll<T>(data: Data<T>, ms: u64)
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
{
    #[cfg(feature = "hydrate")]
    {
        Effect::new(move |_| {
            if let Ok(h) = set_interval_with_handle(
                move || data.refetch(),
                std::time::Duration::from_millis(ms),
            ) {
                on_cleanup(move || h.clear());
            }
        });
    }
    #[cfg(not(feature = "hydrate"))]
    {
        let _ = (data, ms);
    }
}
