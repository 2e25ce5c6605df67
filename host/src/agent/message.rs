//! [`Message`]: the agent's protocol, what one agent says to another, as
//! data. Tensors are in the frame's table (`crate::transport`), referred to
//! by index from the `Value`s.
//!
//! The agent knows three messages: a call, its response, and a request of a
//! kind some feature serves (RRef forks, gradients, plugin deployment, ...).
//! What a feature adds to a call or a response travels as a [`Field`] named
//! after the feature; what a feature's request says is its own encoding
//! ([`Message::Request::body`]). The agent reads neither: each feature owns
//! its wire types (`crate::rref::RRefId`, `crate::dist_autograd`'s envelope,
//! `crate::profiler`'s events).

use serde::{Deserialize, Serialize};

use crate::abi::{RemoteError, Value};
use crate::error::{Error, Result};
use crate::transport::MessageKind;

/// The kind of [`Message::Call`] frames.
pub const CALL: MessageKind = MessageKind::new("Call");
/// The kind of [`Message::Response`] frames.
pub const RESPONSE: MessageKind = MessageKind::new("Response");

/// What one feature adds to a call or a response: the feature's name
/// ([`Extension::name`](super::Extension::name)) and its own encoding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Field {
    /// The feature that wrote it (and alone reads it).
    pub feature: String,
    /// The feature's encoding.
    pub bytes: Vec<u8>,
}

/// The fields of a call or a response.
pub type Fields = Vec<Field>;

/// The field `feature` wrote, if any.
pub(crate) fn field<'a>(fields: &'a [Field], feature: &str) -> Option<&'a [u8]> {
    fields
        .iter()
        .find(|f| f.feature == feature)
        .map(|f| f.bytes.as_slice())
}

/// A wire message. Every request carries an `id`, unique per sender; its
/// reply (a `Response`) carries the same `id`. A request of a kind the
/// receiver does not serve is answered with a `NotImplementedError`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Message {
    /// Run a registered function.
    Call {
        /// Request id.
        id: u64,
        /// The function's qualified name in the callee's registry.
        function: String,
        /// Positional arguments.
        args: Vec<Value>,
        /// Keyword arguments.
        kwargs: Vec<(String, Value)>,
        /// What features add to the call.
        fields: Fields,
    },
    /// The result of a call or a request.
    Response {
        /// The request's id.
        id: u64,
        /// The value, or the error with its kind and message.
        result: std::result::Result<Value, RemoteError>,
        /// What features add to the response.
        fields: Fields,
    },
    /// A request a feature serves.
    Request {
        /// Request id.
        id: u64,
        /// Its kind's name ([`MessageKind::name`]); the receiver finds the
        /// feature that serves it by this name.
        kind: String,
        /// The feature's encoding of the request.
        body: Vec<u8>,
    },
}

impl Message {
    /// The request id, or the id of the request this message answers.
    pub(crate) fn id(&self) -> u64 {
        match self {
            Message::Call { id, .. }
            | Message::Response { id, .. }
            | Message::Request { id, .. } => *id,
        }
    }

    /// Encodes the message for a frame.
    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        // Most messages are small calls and replies: sized for them at once,
        // where a buffer grown from empty is reallocated at 8, 16, 32 and 64
        // bytes on every call.
        const SMALL_MESSAGE: usize = 128;
        crate::abi::encode_append(self, Vec::with_capacity(SMALL_MESSAGE))
            .map_err(|e| Error::runtime(format!("cannot encode message: {e}")))
    }

    /// Decodes a frame's message.
    ///
    /// # Errors
    /// Bytes that are not a message (the connection is then closed, TR-1).
    pub(crate) fn decode(bytes: &[u8]) -> std::result::Result<Message, String> {
        crate::abi::decode(bytes).map_err(|e| format!("malformed message: {e}"))
    }

    /// What a request of this message is called in errors: the function of
    /// a call, the kind of a request.
    pub(crate) fn describe(&self) -> String {
        match self {
            Message::Call { function, .. } => format!("a call of {function}"),
            Message::Response { .. } => "a Response message".to_string(),
            Message::Request { kind, .. } => format!("a {kind} message"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasmrpc_mutation::{huge_numbers, mutate};

    fn call(values: Vec<Value>) -> Message {
        Message::Call {
            id: 7,
            function: "f".into(),
            args: values,
            kwargs: vec![("k".into(), Value::Int(1))],
            fields: vec![Field {
                feature: "dist_autograd".into(),
                bytes: vec![1, 2, 3],
            }],
        }
    }

    /// Regression (found by the `wasmrpc-abi` property tests): a message
    /// whose values nest deeper than `MAX_VALUE_DEPTH` used to recurse once
    /// per level in the decoder, so a peer could overflow the reading
    /// thread's stack; now it is malformed.
    #[test]
    fn values_nested_too_deep_are_malformed() {
        let mut v = Value::None;
        for _ in 0..=crate::abi::MAX_VALUE_DEPTH {
            v = Value::List(vec![v]);
        }
        let bytes = call(vec![v]).encode().unwrap();
        assert!(Message::decode(&bytes).is_err());
    }

    fn mutation() -> impl proptest::strategy::Strategy<Value = wasmrpc_mutation::Mutation> {
        wasmrpc_mutation::mutation(huge_numbers(), 8)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        #[test]
        fn arbitrary_bytes_are_an_error_or_a_message(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
        ) {
            let _ = Message::decode(&bytes);
        }

        /// Requests (plugin deployment among them: a plugin's bytes),
        /// round-tripped, then mutated.
        #[test]
        fn requests_round_trip_and_mutations_are_errors_or_messages(
            kind in ".{0,16}",
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
            ms in proptest::collection::vec(mutation(), 1..4),
        ) {
            let message = Message::Request { id: 9, kind, body };
            let bytes = message.encode().unwrap();
            proptest::prop_assert_eq!(Message::decode(&bytes).unwrap(), message);
            let _ = Message::decode(&mutate(bytes, &ms));
        }

        #[test]
        fn mutated_calls_are_errors_or_messages(
            ints in proptest::collection::vec(proptest::prelude::any::<i64>(), 0..4),
            ms in proptest::collection::vec(mutation(), 1..4),
        ) {
            let message = call(ints.into_iter().map(Value::Int).collect());
            let bytes = message.encode().unwrap();
            proptest::prop_assert_eq!(Message::decode(&bytes).unwrap(), message);
            let _ = Message::decode(&mutate(bytes, &ms));
        }
    }
}
