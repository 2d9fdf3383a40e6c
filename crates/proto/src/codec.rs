//! The codec of every generated client and server: prost's protobuf encoding with smaller
//! per-call buffers.
//!
//! tonic gives each call an encode buffer for its request (or, in a server, its response) and
//! each received message stream a decode buffer, both allocated at the codec's buffer size
//! when the call starts and alive until it ends. tonic-prost's default is 8 KiB each, while
//! the messages of these APIs are a few hundred bytes: a provisioner with its 100 workers in
//! CreateVolume at once held 0.8 MB of encode buffers alone (heaptrack, csi-sidecars at 300
//! claims). [`BUFFER_BYTES`] is the buffers' starting size; both grow as a larger message
//! needs (a ListVolumes page, a device list), so nothing is limited by it. The wire is
//! prost's, unchanged.

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstDecoder, ProstEncoder};

/// The starting size of a call's encode buffer and of its decode buffer.
pub const BUFFER_BYTES: usize = 512;

/// tonic's own threshold from which an encoded stream yields a chunk (32 KiB): unchanged.
const YIELD_THRESHOLD: usize = 32 * 1024;

/// The buffer settings of every call.
pub fn buffer_settings() -> BufferSettings {
    BufferSettings::new(BUFFER_BYTES, YIELD_THRESHOLD)
}

/// prost's codec with [`buffer_settings`]; the generated code's `codec_path`.
#[derive(Debug, Clone)]
pub struct ProstCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for ProstCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for ProstCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(buffer_settings())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(buffer_settings())
    }
}
