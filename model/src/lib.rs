//! The pure domain of Passage. No I/O, compiles to wasm32: everything here is shared by
//! the server, the node agent and the portal.

pub mod api;
pub mod capacity;
pub mod decode;
pub mod error;
#[doc(hidden)]
pub mod fuzzing;
pub mod guest_shape;
pub mod ids;
pub mod images;
pub mod jobs;
pub mod keys;
pub mod metadata;
pub mod networks;
pub mod pci;
pub mod protocol;
mod redact;
mod schema;
pub mod state;
pub mod tags;
pub mod variant;
pub mod vgpu;

pub use error::{ApiErrorBody, ErrorCode};
pub use ids::*;
pub use pci::{
    BarKind, DevicePath, HexId, PciAddress, PciBar, PciDetails, PciDevice, PciParseError,
};
pub use state::{DeviceEvent, DeviceState, TransitionError, transition};
pub use variant::{Variant, VariantError};
