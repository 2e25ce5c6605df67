//! The byte-level protocol of PyTorch's c10d `TCPStore` (torch 2.13).
//!
//! Owns the command codes, the framing and an incremental parser; knows
//! nothing of sockets. Every integer is little-endian (PyTorch writes the
//! host's native order, little-endian on every platform it supports).
//!
//! A request is one byte of [`QueryType`] followed by its arguments:
//! strings and byte vectors are a `u64` length and the bytes; key lists are a
//! `u64` count and that many strings; `ADD` carries an `i64`; `VALIDATE` and
//! `PING` a `u32`. Replies: `GET`, `COMPARE_SET` and each `MULTI_GET` entry
//! are a byte vector; `ADD`, `GETNUMKEYS`, `DELETE_KEY`, `QUEUE_LEN` an `i64`;
//! `CHECK` one [`CHECK_READY`]/[`CHECK_NOT_READY`] byte; `WAIT` one
//! [`STOP_WAITING`] byte when the keys are there, and `CANCEL_WAIT` one
//! [`WAIT_CANCELED`] byte; `PING` echoes its `u32`; `QUEUE_POP` is an `i64`
//! length followed, when non-zero, by a byte vector. `SET`, `APPEND`,
//! `MULTI_SET`, `QUEUE_PUSH` and `VALIDATE` have no reply.
//!
//! Invariants:
//! - TCP-1: a connection's first request is `VALIDATE` with
//!   [`VALIDATION_MAGIC`]; anything else closes it.
//! - TCP-2: the parser never allocates for a length before the bytes it
//!   announces have arrived, and rejects keys over [`MAX_KEY_LEN`], values over
//!   [`MAX_PAYLOAD_LEN`] and key lists over [`MAX_KEY_COUNT`] (the limits of
//!   PyTorch's libuv server).

/// The number a client sends with `VALIDATE`.
pub(crate) const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
/// The longest key the server accepts (PyTorch: `MAX_STRING_LEN`).
pub(crate) const MAX_KEY_LEN: u64 = 8 * 1024;
/// The longest value the server accepts (PyTorch: `MAX_PAYLOAD_LEN`).
pub(crate) const MAX_PAYLOAD_LEN: u64 = 8 * 1024 * 1024;
/// The most keys one request may name (PyTorch: `MAX_KEY_COUNT`).
pub(crate) const MAX_KEY_COUNT: u64 = 128 * 1024;

/// `CHECK` reply: every key exists.
pub(crate) const CHECK_READY: u8 = 0;
/// `CHECK` reply: some key is missing.
pub(crate) const CHECK_NOT_READY: u8 = 1;
/// `WAIT` reply: every key exists.
pub(crate) const STOP_WAITING: u8 = 0;
/// `CANCEL_WAIT` reply.
pub(crate) const WAIT_CANCELED: u8 = 1;

/// PyTorch's `c10d::detail::QueryType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum QueryType {
    Validate = 0,
    Set = 1,
    CompareSet = 2,
    Get = 3,
    Add = 4,
    Check = 5,
    Wait = 6,
    GetNumKeys = 7,
    DeleteKey = 8,
    Append = 9,
    MultiGet = 10,
    MultiSet = 11,
    CancelWait = 12,
    Ping = 13,
    QueuePush = 14,
    QueuePop = 15,
    QueueLen = 16,
}

impl QueryType {
    fn from_u8(code: u8) -> Option<Self> {
        use QueryType::*;
        Some(match code {
            0 => Validate,
            1 => Set,
            2 => CompareSet,
            3 => Get,
            4 => Add,
            5 => Check,
            6 => Wait,
            7 => GetNumKeys,
            8 => DeleteKey,
            9 => Append,
            10 => MultiGet,
            11 => MultiSet,
            12 => CancelWait,
            13 => Ping,
            14 => QueuePush,
            15 => QueuePop,
            16 => QueueLen,
            _ => return None,
        })
    }
}

/// One parsed request. Keys are raw bytes: PyTorch clients may send any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Command {
    Validate(u32),
    Set(Vec<u8>, Vec<u8>),
    CompareSet {
        key: Vec<u8>,
        expected: Vec<u8>,
        desired: Vec<u8>,
    },
    Get(Vec<u8>),
    Add(Vec<u8>, i64),
    Check(Vec<Vec<u8>>),
    Wait(Vec<Vec<u8>>),
    GetNumKeys,
    DeleteKey(Vec<u8>),
    Append(Vec<u8>, Vec<u8>),
    MultiGet(Vec<Vec<u8>>),
    MultiSet(Vec<(Vec<u8>, Vec<u8>)>),
    CancelWait,
    Ping(u32),
    QueuePush(Vec<u8>, Vec<u8>),
    QueuePop(Vec<u8>),
    QueueLen(Vec<u8>),
}

/// Why a buffer does not (yet) hold a command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ParseError {
    /// More bytes are needed.
    Incomplete,
    /// The bytes break the protocol; the connection must be closed.
    Invalid(String),
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ParseError> {
        let end = self.pos.checked_add(n).ok_or(ParseError::Incomplete)?;
        let bytes = self.buf.get(self.pos..end).ok_or(ParseError::Incomplete)?;
        self.pos = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], ParseError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, ParseError> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32, ParseError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, ParseError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn i64(&mut self) -> Result<i64, ParseError> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    /// A length-prefixed field of at most `max` bytes (TCP-2).
    fn field(&mut self, max: u64, what: &str) -> Result<Vec<u8>, ParseError> {
        let len = self.u64()?;
        if len > max {
            return Err(ParseError::Invalid(format!(
                "{what} of {len} bytes exceeds the limit of {max}"
            )));
        }
        // `len <= max` fits in usize on every supported target.
        let len =
            usize::try_from(len).map_err(|_| ParseError::Invalid(format!("{what} too long")))?;
        Ok(self.take(len)?.to_vec())
    }

    fn key(&mut self) -> Result<Vec<u8>, ParseError> {
        self.field(MAX_KEY_LEN, "key")
    }

    fn payload(&mut self) -> Result<Vec<u8>, ParseError> {
        self.field(MAX_PAYLOAD_LEN, "value")
    }

    fn count(&mut self) -> Result<u64, ParseError> {
        let n = self.u64()?;
        if n > MAX_KEY_COUNT {
            return Err(ParseError::Invalid(format!(
                "request names {n} keys, more than the limit of {MAX_KEY_COUNT}"
            )));
        }
        Ok(n)
    }

    fn keys(&mut self) -> Result<Vec<Vec<u8>>, ParseError> {
        let n = self.count()?;
        // Grow as keys arrive rather than trusting the count (TCP-2).
        let mut keys = Vec::new();
        for _ in 0..n {
            keys.push(self.key()?);
        }
        Ok(keys)
    }
}

/// Parses the command at the start of `buf`; on success returns it and the
/// number of bytes it used.
pub(crate) fn parse_command(buf: &[u8]) -> Result<(Command, usize), ParseError> {
    let mut c = Cursor { buf, pos: 0 };
    let code = c.u8()?;
    let query = QueryType::from_u8(code)
        .ok_or_else(|| ParseError::Invalid(format!("unknown command code {code}")))?;
    let command = match query {
        QueryType::Validate => Command::Validate(c.u32()?),
        QueryType::Set => Command::Set(c.key()?, c.payload()?),
        QueryType::CompareSet => Command::CompareSet {
            key: c.key()?,
            expected: c.payload()?,
            desired: c.payload()?,
        },
        QueryType::Get => Command::Get(c.key()?),
        QueryType::Add => Command::Add(c.key()?, c.i64()?),
        QueryType::Check => Command::Check(c.keys()?),
        QueryType::Wait => Command::Wait(c.keys()?),
        QueryType::GetNumKeys => Command::GetNumKeys,
        QueryType::DeleteKey => Command::DeleteKey(c.key()?),
        QueryType::Append => Command::Append(c.key()?, c.payload()?),
        QueryType::MultiGet => Command::MultiGet(c.keys()?),
        QueryType::MultiSet => {
            let n = c.count()?;
            let mut pairs = Vec::new();
            for _ in 0..n {
                pairs.push((c.key()?, c.payload()?));
            }
            Command::MultiSet(pairs)
        }
        QueryType::CancelWait => Command::CancelWait,
        QueryType::Ping => Command::Ping(c.u32()?),
        QueryType::QueuePush => Command::QueuePush(c.key()?, c.payload()?),
        QueryType::QueuePop => Command::QueuePop(c.key()?),
        QueryType::QueueLen => Command::QueueLen(c.key()?),
    };
    Ok((command, c.pos))
}

/// Builds a request or a reply.
#[derive(Debug, Default)]
pub(crate) struct Frame(pub(crate) Vec<u8>);

impl Frame {
    /// A request starting with its command byte.
    pub(crate) fn request(query: QueryType) -> Self {
        let mut buf = Vec::with_capacity(32);
        buf.push(query as u8);
        Self(buf)
    }

    pub(crate) fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }

    pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub(crate) fn i64(&mut self, v: i64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// A `u64` length and the bytes.
    pub(crate) fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u64(v.len() as u64);
        self.0.extend_from_slice(v);
        self
    }

    /// A `u64` count and each key.
    pub(crate) fn keys<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> &mut Self {
        self.u64(keys.len() as u64);
        for k in keys {
            self.bytes(k.as_ref());
        }
        self
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn all_commands() -> Vec<(Vec<u8>, Command)> {
        let mut out = Vec::new();
        let mut f = Frame::request(QueryType::Validate);
        f.u32(VALIDATION_MAGIC);
        out.push((f.0, Command::Validate(VALIDATION_MAGIC)));
        let mut f = Frame::request(QueryType::Set);
        f.bytes(b"/k").bytes(b"v");
        out.push((f.0, Command::Set(b"/k".to_vec(), b"v".to_vec())));
        let mut f = Frame::request(QueryType::CompareSet);
        f.bytes(b"/k").bytes(b"").bytes(b"d");
        out.push((
            f.0,
            Command::CompareSet {
                key: b"/k".to_vec(),
                expected: vec![],
                desired: b"d".to_vec(),
            },
        ));
        let mut f = Frame::request(QueryType::Add);
        f.bytes(b"/a").i64(-5);
        out.push((f.0, Command::Add(b"/a".to_vec(), -5)));
        let mut f = Frame::request(QueryType::Wait);
        f.keys(&[b"/a".as_slice(), b"/b"]);
        out.push((f.0, Command::Wait(vec![b"/a".to_vec(), b"/b".to_vec()])));
        let mut f = Frame::request(QueryType::MultiSet);
        f.u64(1).bytes(b"/a").bytes(b"1");
        out.push((
            f.0,
            Command::MultiSet(vec![(b"/a".to_vec(), b"1".to_vec())]),
        ));
        out.push((Frame::request(QueryType::GetNumKeys).0, Command::GetNumKeys));
        let mut f = Frame::request(QueryType::Ping);
        f.u32(1234);
        out.push((f.0, Command::Ping(1234)));
        out
    }

    #[test]
    fn requests_round_trip() {
        for (bytes, want) in all_commands() {
            let (got, used) = parse_command(&bytes).unwrap();
            assert_eq!(got, want);
            assert_eq!(used, bytes.len());
        }
    }

    #[test]
    fn set_matches_bytes_captured_from_torch() {
        // Captured from torch 2.13's client: set("k", "v") then add("a", 5).
        let wire = [
            0x01, 2, 0, 0, 0, 0, 0, 0, 0, b'/', b'k', 1, 0, 0, 0, 0, 0, 0, 0, b'v', 0x04, 2, 0, 0,
            0, 0, 0, 0, 0, b'/', b'a', 5, 0, 0, 0, 0, 0, 0, 0,
        ];
        let (first, used) = parse_command(&wire).unwrap();
        assert_eq!(first, Command::Set(b"/k".to_vec(), b"v".to_vec()));
        let (second, _) = parse_command(&wire[used..]).unwrap();
        assert_eq!(second, Command::Add(b"/a".to_vec(), 5));
    }

    #[test]
    fn every_prefix_is_incomplete() {
        for (bytes, _) in all_commands() {
            for cut in 0..bytes.len() {
                assert_eq!(
                    parse_command(&bytes[..cut]),
                    Err(ParseError::Incomplete),
                    "{bytes:?} cut at {cut}"
                );
            }
        }
    }

    #[test]
    fn garbage_is_invalid_not_a_panic() {
        assert!(matches!(parse_command(&[200]), Err(ParseError::Invalid(_))));
        let mut f = Frame::request(QueryType::Get);
        f.u64(u64::MAX);
        assert!(matches!(parse_command(&f.0), Err(ParseError::Invalid(_))));
        let mut f = Frame::request(QueryType::Wait);
        f.u64(u64::MAX);
        assert!(matches!(parse_command(&f.0), Err(ParseError::Invalid(_))));
        let mut f = Frame::request(QueryType::Set);
        f.bytes(b"k").u64(MAX_PAYLOAD_LEN + 1);
        assert!(matches!(parse_command(&f.0), Err(ParseError::Invalid(_))));
    }

    #[test]
    fn random_bytes_never_panic() {
        // A small xorshift generator keeps the test deterministic.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..20_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = (state % 40) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|i| (state >> (i % 8 * 8)) as u8 % 20)
                .collect();
            let _ = parse_command(&bytes);
        }
    }

    /// Valid requests of every kind, for mutation.
    pub(crate) fn valid_requests() -> Vec<Vec<u8>> {
        let mut out: Vec<Vec<u8>> = all_commands().into_iter().map(|(b, _)| b).collect();
        for (query, key) in [
            (QueryType::Get, b"/k".as_slice()),
            (QueryType::DeleteKey, b"/k"),
            (QueryType::QueuePop, b"/q"),
            (QueryType::QueueLen, b"/q"),
        ] {
            let mut f = Frame::request(query);
            f.bytes(key);
            out.push(f.0);
        }
        for query in [QueryType::Append, QueryType::QueuePush] {
            let mut f = Frame::request(query);
            f.bytes(b"/k").bytes(b"value");
            out.push(f.0);
        }
        for query in [QueryType::Check, QueryType::MultiGet] {
            let mut f = Frame::request(query);
            f.keys(&[b"/a".as_slice(), b"/b", b""]);
            out.push(f.0);
        }
        out.push(Frame::request(QueryType::CancelWait).0);
        out
    }

    pub(crate) use wasmrpc_mutation::mutate;

    /// Mutations of a valid request that plant huge numbers, this
    /// protocol's own limits among them, as little-endian `u64`s.
    pub(crate) fn mutation() -> impl proptest::strategy::Strategy<Value = wasmrpc_mutation::Mutation>
    {
        use proptest::prelude::*;
        wasmrpc_mutation::mutation(
            prop_oneof![
                Just(u64::MAX),
                Just(MAX_PAYLOAD_LEN),
                Just(MAX_KEY_COUNT),
                any::<u64>()
            ],
            8,
        )
    }

    /// What every parse must satisfy: a command uses between 1 and all of
    /// the bytes, parses the same from exactly those bytes, and the same
    /// with more bytes after it; a buffer that is `Incomplete` stays
    /// `Incomplete` when cut shorter.
    fn check_parse(bytes: &[u8]) -> Result<(), proptest::test_runner::TestCaseError> {
        use proptest::prop_assert;
        use proptest::prop_assert_eq;
        match parse_command(bytes) {
            Ok((command, used)) => {
                prop_assert!(used >= 1 && used <= bytes.len());
                prop_assert_eq!(parse_command(&bytes[..used]), Ok((command.clone(), used)));
                let mut longer = bytes[..used].to_vec();
                longer.extend_from_slice(&[0xAB; 9]);
                prop_assert_eq!(parse_command(&longer), Ok((command, used)));
            }
            Err(ParseError::Incomplete) => {
                for cut in 0..bytes.len() {
                    prop_assert_eq!(parse_command(&bytes[..cut]), Err(ParseError::Incomplete));
                }
            }
            Err(ParseError::Invalid(_)) => {}
        }
        Ok(())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        #[test]
        fn arbitrary_requests_parse_consistently(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
        ) {
            check_parse(&bytes)?;
        }

        #[test]
        fn mutated_requests_parse_consistently(
            which in proptest::prelude::any::<usize>(),
            ms in proptest::collection::vec(mutation(), 1..4),
        ) {
            let valid = valid_requests();
            let bytes = mutate(valid[which % valid.len()].clone(), &ms);
            check_parse(&bytes)?;
        }
    }

    #[test]
    fn announced_lengths_over_the_limits_are_refused_before_their_bytes() {
        // A key, a value and a key count each one over their limit, with
        // none of the bytes they announce: refused at once (TCP-2), not
        // waited for.
        let mut f = Frame::request(QueryType::Get);
        f.u64(MAX_KEY_LEN + 1);
        assert!(matches!(parse_command(&f.0), Err(ParseError::Invalid(_))));
        let mut f = Frame::request(QueryType::QueuePush);
        f.bytes(b"/q").u64(MAX_PAYLOAD_LEN + 1);
        assert!(matches!(parse_command(&f.0), Err(ParseError::Invalid(_))));
        let mut f = Frame::request(QueryType::MultiSet);
        f.u64(MAX_KEY_COUNT + 1);
        assert!(matches!(parse_command(&f.0), Err(ParseError::Invalid(_))));
        // Within the limits, missing bytes are only Incomplete.
        let mut f = Frame::request(QueryType::Set);
        f.bytes(b"/k").u64(MAX_PAYLOAD_LEN);
        assert_eq!(parse_command(&f.0), Err(ParseError::Incomplete));
    }
}
