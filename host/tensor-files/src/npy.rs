//! numpy's `.npy` format, versions 1.0, 2.0 and 3.0.
//!
//! A file is the magic `\x93NUMPY`, a version (major, minor), the header's
//! length (2 bytes little-endian in 1.0, 4 bytes in 2.0 and 3.0), the
//! header (a Python dict literal such as
//! `{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }`, padded
//! with spaces and a newline), then the raw elements. Reading works over
//! any [`Read`] so that `.npz` members are inflated only as far as needed.

use std::io::Read;

use crate::error::NPY_DTYPES;
use crate::{DType, FileError, Format, NPY_MAGIC, TensorBytes};

/// The longest header read. numpy itself refuses headers over 10,000
/// bytes unless told otherwise; this is lenient yet keeps a crafted
/// length from making a `.npz` member allocate gigabytes.
const MAX_HEADER_LEN: u32 = 1 << 20;

/// The most dimensions an array may have (numpy 2's own limit).
const MAX_DIMS: usize = 64;

/// How deep a header's literals may nest (structured dtypes nest).
const MAX_DEPTH: usize = 16;

/// A parsed header: what the data that follows holds.
#[derive(Debug)]
pub(crate) struct Header {
    dtype: DType,
    big_endian: bool,
    fortran_order: bool,
    shape: Vec<u64>,
    /// The exact number of data bytes that must follow the header.
    pub(crate) data_len: usize,
}

fn malformed(file: &str, reason: impl Into<String>) -> FileError {
    FileError::Malformed {
        file: file.to_owned(),
        format: Format::Npy,
        reason: reason.into(),
    }
}

/// Reads `len` bytes exactly, or explains what was short.
fn read_exact_or(
    file: &str,
    reader: &mut impl Read,
    buffer: &mut [u8],
    what: &str,
) -> Result<(), FileError> {
    reader
        .read_exact(buffer)
        .map_err(|error| match error.kind() {
            std::io::ErrorKind::UnexpectedEof => malformed(file, format!("it ends inside {what}")),
            _ => malformed(file, format!("reading {what} failed ({error})")),
        })
}

/// Reads the magic, version and header, leaving `reader` at the data.
pub(crate) fn read_header(file: &str, reader: &mut impl Read) -> Result<Header, FileError> {
    let mut preamble = [0u8; 8];
    read_exact_or(file, reader, &mut preamble, "the magic and version")?;
    if !preamble.starts_with(NPY_MAGIC) {
        return Err(malformed(
            file,
            "it does not start with the .npy magic \\x93NUMPY",
        ));
    }
    let (major, minor) = (preamble[6], preamble[7]);
    let header_len = match major {
        1 => {
            let mut length = [0u8; 2];
            read_exact_or(file, reader, &mut length, "the header length")?;
            u32::from(u16::from_le_bytes(length))
        }
        2 | 3 => {
            let mut length = [0u8; 4];
            read_exact_or(file, reader, &mut length, "the header length")?;
            u32::from_le_bytes(length)
        }
        _ => {
            return Err(malformed(
                file,
                format!("its format version {major}.{minor} is not 1.0, 2.0 or 3.0"),
            ));
        }
    };
    if header_len > MAX_HEADER_LEN {
        return Err(malformed(
            file,
            format!("its header length {header_len} is over the {MAX_HEADER_LEN} bytes allowed"),
        ));
    }
    // Read through `take` rather than into a buffer of the declared size,
    // so a short file costs only the bytes it has.
    let mut header = Vec::new();
    reader
        .take(u64::from(header_len))
        .read_to_end(&mut header)
        .map_err(|error| malformed(file, format!("reading the header failed ({error})")))?;
    if header.len() != header_len as usize {
        return Err(malformed(
            file,
            format!(
                "its header length is {header_len} bytes but only {} bytes follow",
                header.len()
            ),
        ));
    }
    // Versions 1.0 and 2.0 are latin-1, 3.0 UTF-8; a real header is ASCII.
    let text =
        std::str::from_utf8(&header).map_err(|_| malformed(file, "its header is not text"))?;
    parse_header(file, text)
}

/// Reads the data after the header: exactly `header.data_len` bytes and
/// nothing after them, converted to little-endian C order.
pub(crate) fn read_data(
    file: &str,
    reader: &mut impl Read,
    header: &Header,
) -> Result<TensorBytes, FileError> {
    let wanted = header.data_len as u64;
    let mut data = Vec::new();
    // One byte more than wanted tells trailing bytes apart from none, and
    // stops a compressed member from inflating further.
    reader
        .take(wanted.saturating_add(1))
        .read_to_end(&mut data)
        .map_err(|error| malformed(file, format!("reading the data failed ({error})")))?;
    if (data.len() as u64) < wanted {
        return Err(malformed(
            file,
            format!(
                "its header promises {wanted} bytes of data ({} {:?}) but only {} bytes follow",
                crate::dtype_name(header.dtype),
                header.shape,
                data.len()
            ),
        ));
    }
    if data.len() as u64 > wanted {
        return Err(malformed(
            file,
            format!("there are bytes after the {wanted} bytes of data its header promises"),
        ));
    }
    let size = header.dtype.size();
    if header.big_endian && size > 1 {
        for element in data.chunks_exact_mut(size) {
            element.reverse();
        }
    }
    if header.fortran_order && header.shape.len() > 1 && !data.is_empty() {
        data = fortran_to_c(&data, &header.shape, size);
    }
    crate::check_bools(header.dtype, &data).map_err(|reason| malformed(file, reason))?;
    Ok(TensorBytes {
        dtype: header.dtype,
        shape: crate::shape_i64(&header.shape),
        data,
    })
}

/// Permutes elements stored in Fortran order (first index fastest) into C
/// order (last index fastest). `data` holds exactly the product of `shape`
/// elements of `size` bytes, none of the dimensions zero.
fn fortran_to_c(data: &[u8], shape: &[u64], size: usize) -> Vec<u8> {
    let dims: Vec<usize> = shape.iter().map(|&dim| dim as usize).collect();
    // The Fortran stride of each dimension, in elements.
    let mut strides = Vec::with_capacity(dims.len());
    let mut stride = 1usize;
    for &dim in &dims {
        strides.push(stride);
        stride = stride.saturating_mul(dim);
    }
    let count = data.len() / size;
    let mut out = Vec::with_capacity(data.len());
    let mut index = vec![0usize; dims.len()];
    let mut source = 0usize;
    for _ in 0..count {
        let start = source * size;
        out.extend_from_slice(data.get(start..start + size).unwrap_or_default());
        // Advance the C-order index (an odometer, last digit fastest) and
        // keep the Fortran offset of that index in step.
        for axis in (0..dims.len()).rev() {
            index[axis] += 1;
            source += strides[axis];
            if index[axis] < dims[axis] {
                break;
            }
            source -= dims[axis] * strides[axis];
            index[axis] = 0;
        }
    }
    out
}

/// Parses the header dict and checks it describes an array this crate
/// reads.
fn parse_header(file: &str, text: &str) -> Result<Header, FileError> {
    let entries = parse_dict(text).map_err(|reason| malformed(file, reason))?;
    let mut descr = None;
    let mut fortran_order = None;
    let mut shape = None;
    for (key, value, raw) in entries {
        let slot_taken = match key.as_str() {
            "descr" => descr.replace((value, raw)).is_some(),
            "fortran_order" => fortran_order.replace(value).is_some(),
            "shape" => shape.replace(value).is_some(),
            _ => {
                return Err(malformed(
                    file,
                    format!(
                        "its header has the key '{key}'; a header has only 'descr', \
                         'fortran_order' and 'shape'"
                    ),
                ));
            }
        };
        if slot_taken {
            return Err(malformed(
                file,
                format!("its header has the key '{key}' twice"),
            ));
        }
    }
    let missing = |key: &str| malformed(file, format!("its header has no '{key}'"));
    let (descr, raw_descr) = descr.ok_or_else(|| missing("descr"))?;
    let fortran_order = match fortran_order.ok_or_else(|| missing("fortran_order"))? {
        PyValue::Bool(value) => value,
        _ => {
            return Err(malformed(
                file,
                "its header's 'fortran_order' is not True or False",
            ));
        }
    };
    let shape = match shape.ok_or_else(|| missing("shape"))? {
        PyValue::Tuple(items) => items
            .into_iter()
            .map(|item| match item {
                PyValue::Int(dim) => u64::try_from(dim).map_err(|_| {
                    malformed(file, format!("its shape has the negative dimension {dim}"))
                }),
                _ => Err(malformed(file, "its shape is not a tuple of integers")),
            })
            .collect::<Result<Vec<u64>, _>>()?,
        _ => return Err(malformed(file, "its header's 'shape' is not a tuple")),
    };
    if shape.len() > MAX_DIMS {
        return Err(malformed(
            file,
            format!(
                "its shape has {} dimensions, over the {MAX_DIMS} allowed",
                shape.len()
            ),
        ));
    }
    let descr = match descr {
        PyValue::Str(descr) => descr,
        // A list is a structured dtype: records of named fields.
        _ => {
            return Err(FileError::Unsupported {
                file: file.to_owned(),
                what: format!("the structured dtype {raw_descr}"),
                supported: NPY_DTYPES,
            });
        }
    };
    let (dtype, big_endian) = parse_descr(file, &descr)?;
    let data_len = crate::data_len(dtype, &shape).map_err(|reason| malformed(file, reason))?;
    Ok(Header {
        dtype,
        big_endian,
        fortran_order,
        shape,
        data_len,
    })
}

/// Maps a descr such as `<f4` to a dtype and whether it is big-endian.
fn parse_descr(file: &str, descr: &str) -> Result<(DType, bool), FileError> {
    let unsupported = || FileError::Unsupported {
        file: file.to_owned(),
        what: format!("the dtype '{descr}'"),
        supported: NPY_DTYPES,
    };
    let mut chars = descr.chars();
    let big_endian = match chars.next() {
        Some('<' | '|' | '=') => false,
        Some('>') => true,
        _ => return Err(unsupported()),
    };
    let dtype = match chars.as_str() {
        "f2" => DType::Float16,
        "f4" => DType::Float32,
        "f8" => DType::Float64,
        "i1" => DType::Int8,
        "i2" => DType::Int16,
        "i4" => DType::Int32,
        "i8" => DType::Int64,
        "u1" => DType::UInt8,
        "b1" => DType::Bool,
        "O" | "O8" | "O4" => {
            return Err(FileError::ObjectArray {
                file: file.to_owned(),
                descr: descr.to_owned(),
            });
        }
        _ => return Err(unsupported()),
    };
    Ok((dtype, big_endian))
}

/// A Python literal as found in `.npy` headers.
#[derive(Debug, PartialEq)]
enum PyValue {
    Str(String),
    Bool(bool),
    None,
    Int(i64),
    Tuple(Vec<PyValue>),
    List(Vec<PyValue>),
}

/// A dict literal's entries: key, value, and the value's source text (for
/// messages about dtypes this crate does not read).
type DictEntries = Vec<(String, PyValue, String)>;

/// Parses `{key: value, ...}` followed only by whitespace.
fn parse_dict(text: &str) -> Result<DictEntries, String> {
    let mut parser = Parser {
        text: text.as_bytes(),
        pos: 0,
    };
    parser.skip_space();
    parser.expect(b'{')?;
    let mut entries = Vec::new();
    loop {
        parser.skip_space();
        if parser.eat(b'}') {
            break;
        }
        let key = match parser.value(0)? {
            PyValue::Str(key) => key,
            _ => return Err("its header has a key that is not a string".into()),
        };
        parser.skip_space();
        parser.expect(b':')?;
        parser.skip_space();
        let start = parser.pos;
        let value = parser.value(0)?;
        let raw = String::from_utf8_lossy(&parser.text[start..parser.pos]).into_owned();
        entries.push((key, value, raw));
        parser.skip_space();
        if !parser.eat(b',') {
            parser.skip_space();
            parser.expect(b'}')?;
            break;
        }
    }
    parser.skip_space();
    if parser.pos != parser.text.len() {
        return Err("its header has text after the dict".into());
    }
    Ok(entries)
}

/// A recursive-descent parser over the header's bytes. Every step either
/// consumes a byte or fails, and nesting is bounded by [`MAX_DEPTH`], so it
/// ends on any input.
struct Parser<'a> {
    text: &'a [u8],
    pos: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.text.get(self.pos).copied()
    }

    fn eat(&mut self, byte: u8) -> bool {
        if self.peek() == Some(byte) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, byte: u8) -> Result<(), String> {
        if self.eat(byte) {
            Ok(())
        } else {
            Err(format!(
                "its header dict does not parse (expected '{}' at byte {})",
                byte as char, self.pos
            ))
        }
    }

    fn skip_space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn value(&mut self, depth: usize) -> Result<PyValue, String> {
        if depth > MAX_DEPTH {
            return Err("its header nests deeper than any dtype does".into());
        }
        match self.peek() {
            Some(quote @ (b'\'' | b'"')) => self.string(quote),
            Some(b'(') => {
                self.pos += 1;
                self.sequence(b')', depth).map(PyValue::Tuple)
            }
            Some(b'[') => {
                self.pos += 1;
                self.sequence(b']', depth).map(PyValue::List)
            }
            Some(b'-' | b'0'..=b'9') => self.integer(),
            Some(b'A'..=b'Z' | b'a'..=b'z') => {
                let start = self.pos;
                while matches!(self.peek(), Some(b'A'..=b'Z' | b'a'..=b'z' | b'_')) {
                    self.pos += 1;
                }
                match &self.text[start..self.pos] {
                    b"True" => Ok(PyValue::Bool(true)),
                    b"False" => Ok(PyValue::Bool(false)),
                    b"None" => Ok(PyValue::None),
                    other => Err(format!(
                        "its header has the unknown name '{}'",
                        String::from_utf8_lossy(other)
                    )),
                }
            }
            _ => Err(format!(
                "its header dict does not parse (unexpected text at byte {})",
                self.pos
            )),
        }
    }

    /// Items up to `close`, comma-separated, a trailing comma allowed.
    fn sequence(&mut self, close: u8, depth: usize) -> Result<Vec<PyValue>, String> {
        let mut items = Vec::new();
        loop {
            self.skip_space();
            if self.eat(close) {
                return Ok(items);
            }
            items.push(self.value(depth + 1)?);
            self.skip_space();
            if !self.eat(b',') {
                self.skip_space();
                self.expect(close)?;
                return Ok(items);
            }
        }
    }

    fn string(&mut self, quote: u8) -> Result<PyValue, String> {
        self.pos += 1;
        let start = self.pos;
        loop {
            match self.peek() {
                None => return Err("its header has a string that does not end".into()),
                // An escape: keep both bytes; only dtypes this crate
                // refuses (structured field names) have any.
                Some(b'\\') => self.pos = (self.pos + 2).min(self.text.len()),
                Some(byte) if byte == quote => break,
                Some(_) => self.pos += 1,
            }
        }
        let value = String::from_utf8_lossy(&self.text[start..self.pos]).into_owned();
        self.pos += 1;
        Ok(PyValue::Str(value))
    }

    fn integer(&mut self) -> Result<PyValue, String> {
        let start = self.pos;
        self.eat(b'-');
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.pos += 1;
        }
        let digits = std::str::from_utf8(&self.text[start..self.pos]).unwrap_or_default();
        // Python 2 wrote longs as `3L`.
        self.eat(b'L');
        digits
            .parse::<i64>()
            .map(PyValue::Int)
            .map_err(|_| format!("its header has the number {digits}, which is not a valid size"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_numpy_headers() {
        let entries = parse_dict(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }   \n",
        )
        .map(|entries| {
            entries
                .into_iter()
                .map(|(k, v, _)| (k, v))
                .collect::<Vec<_>>()
        });
        assert_eq!(
            entries,
            Ok(vec![
                ("descr".into(), PyValue::Str("<f4".into())),
                ("fortran_order".into(), PyValue::Bool(false)),
                (
                    "shape".into(),
                    PyValue::Tuple(vec![PyValue::Int(3), PyValue::Int(4)])
                ),
            ])
        );
        assert!(parse_dict("{'shape': (3L,), 'x': None}").is_ok());
        assert!(parse_dict("{'shape': ()}").is_ok());
        assert!(parse_dict("{'shape': (3,4)").is_err());
        assert!(parse_dict("{'shape': (3,4)} x").is_err());
        assert!(parse_dict(&format!("{{'a': {}}}", "(".repeat(100))).is_err());
        assert!(parse_dict("{'shape': (99999999999999999999,)}").is_err());
    }

    #[test]
    fn fortran_order_is_permuted_to_c_order() {
        // The 2x3 matrix [[0, 1, 2], [3, 4, 5]] stored column by column.
        let fortran = [0u8, 3, 1, 4, 2, 5];
        assert_eq!(fortran_to_c(&fortran, &[2, 3], 1), vec![0, 1, 2, 3, 4, 5]);
        // A 2x2x2 array: element (i, j, k) is 4i + 2j + k, stored with i
        // fastest.
        let mut fortran = Vec::new();
        for k in 0..2u8 {
            for j in 0..2u8 {
                for i in 0..2u8 {
                    fortran.push(4 * i + 2 * j + k);
                }
            }
        }
        assert_eq!(
            fortran_to_c(&fortran, &[2, 2, 2], 1),
            (0..8).collect::<Vec<u8>>()
        );
    }
}
