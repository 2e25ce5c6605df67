//! Reading an operator's schema text (`aten::add.Tensor(Tensor self, Tensor
//! other, *, Scalar alpha=1) -> Tensor`) for what the op policy must know:
//! its parameters, and whether any of them is a [`Hazard`] (POL-3).
//!
//! What this module owns: the parameter parser, the hazard rules, and the
//! conservative test of whether a call could bind an overload
//! ([`Overload::could_bind`]); libtorch's real matching stays in the shim.

use std::fmt;

use wasmrpc_torch_sys::OpValue;

/// Why a parameter makes an overload unsafe to run for a caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HazardKind {
    /// A `Storage`: raw memory, set under a tensor (`aten::set_`).
    Storage,
    /// A `Stream` (CUDA streams are the host's).
    Stream,
    /// A `Generator` a caller would have to pass (not `Generator? =None`):
    /// the worker owns its random state.
    Generator,
    /// An `int` named like an address (`ptr`, `data_ptr`, `address`).
    RawPointer,
    /// A `str` naming a file (`filename`, `path`, `file`, `f`).
    FileName,
    /// An opaque or generic type (`Any`, a type variable such as `t`,
    /// `Capsule`, a `__torch__` class, `Future`, `RRef`, `Dict`, an enum,
    /// varargs, or any type not known to be a plain value): TorchScript
    /// containers and objects, no tensor computation, and nothing the
    /// policy can reason about.
    Opaque,
}

impl HazardKind {
    /// The words for it in an error ("a file name").
    pub fn describe(self) -> &'static str {
        match self {
            HazardKind::Storage => "a Storage (raw memory)",
            HazardKind::Stream => "a Stream",
            HazardKind::Generator => "a Generator the caller passes",
            HazardKind::RawPointer => "a raw pointer",
            HazardKind::FileName => "a file name",
            HazardKind::Opaque => "an opaque or generic type",
        }
    }
}

/// One unsafe parameter of one overload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hazard {
    /// What makes it unsafe.
    pub kind: HazardKind,
    /// The parameter as the schema declares it (`str filename`).
    pub param: String,
    /// The overload's whole schema.
    pub schema: String,
}

impl fmt::Display for Hazard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "takes {} (`{}` in `{}`)",
            self.kind.describe(),
            self.param,
            self.schema
        )
    }
}

/// A parameter of a schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Param {
    /// The type as written, alias annotations included (`Tensor(a!)`).
    pub(crate) ty: String,
    /// The name (`self`).
    pub(crate) name: String,
    /// The default as written (`None`, `1`, `[]`), if any.
    pub(crate) default: Option<String>,
    /// Declared after `*`: callers must name it.
    pub(crate) keyword_only: bool,
}

/// Type names that hold plain values: what a caller's arguments can fill
/// and kernels read as data. Anything else is [`HazardKind::Opaque`] (the
/// rule fails closed: a type libtorch adds later is refused until added
/// here).
const PLAIN_TYPES: &[&str] = &[
    "Tensor",
    "int",
    "float",
    "bool",
    "str",
    "complex",
    "Scalar",
    "ScalarType",
    "Layout",
    "MemoryFormat",
    "Device",
    "SymInt",
    "SymFloat",
    "SymBool",
    "Dimname",
    "QScheme",
    "NoneType",
    "int64_t",
];

/// Parameter names that make a `str` a file.
const FILE_PARAMS: &[&str] = &["filename", "path", "file", "f"];

/// Splits `s` at top-level commas (outside brackets, parentheses and
/// quotes).
fn split_top_level(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut quote, mut start) = (0i32, None::<char>, 0);
    for (i, c) in s.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '"' | '\'') => quote = Some(c),
            (None, '(' | '[') => depth += 1,
            (None, ')' | ']') => depth -= 1,
            (None, ',') if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

/// The parameters of `schema`, or `None` if it does not parse (callers
/// treat that as a hazard: fail closed).
pub(crate) fn parse_params(schema: &str) -> Option<Vec<Param>> {
    let open = schema.find('(')?;
    // The matching parenthesis of the argument list.
    let mut depth = 0i32;
    let mut close = None;
    let mut quote = None::<char>;
    for (i, c) in schema[open..].char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '"' | '\'') => quote = Some(c),
            (None, '(' | '[') => depth += 1,
            (None, ')' | ']') => {
                depth -= 1;
                if depth == 0 {
                    close = Some(open + i);
                    break;
                }
            }
            _ => {}
        }
    }
    let inner = &schema[open + 1..close?];
    let mut params = Vec::new();
    let mut keyword_only = false;
    if inner.trim().is_empty() {
        return Some(params);
    }
    for part in split_top_level(inner) {
        let part = part.trim();
        match part {
            "*" => {
                keyword_only = true;
                continue;
            }
            // Varargs: nothing the policy can reason about.
            "..." => {
                params.push(Param {
                    ty: "...".into(),
                    name: "...".into(),
                    default: None,
                    keyword_only,
                });
                continue;
            }
            _ => {}
        }
        let (decl, default) = match split_default(part) {
            Some((decl, default)) => (decl.trim(), Some(default.trim().to_owned())),
            None => (part, None),
        };
        let (ty, name) = decl.rsplit_once(' ')?;
        params.push(Param {
            ty: ty.trim().to_owned(),
            name: name.trim().to_owned(),
            default,
            keyword_only,
        });
    }
    Some(params)
}

/// `decl=default` split at the first `=` outside brackets and quotes.
fn split_default(part: &str) -> Option<(&str, &str)> {
    let (mut depth, mut quote) = (0i32, None::<char>);
    for (i, c) in part.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '"' | '\'') => quote = Some(c),
            (None, '(' | '[') => depth += 1,
            (None, ')' | ']') => depth -= 1,
            (None, '=') if depth == 0 => return Some((&part[..i], &part[i + 1..])),
            _ => {}
        }
    }
    None
}

/// The type words of a parameter type, alias annotations (`(a!)`, `(a ->
/// *)`, `(b|a)`) and fixed list sizes (`[2]`) left out: `Tensor(a!)[]` →
/// `Tensor`; `Dict(str, t)` → `Dict`, `str`, `t`.
fn type_words(ty: &str) -> Vec<&str> {
    let bytes = ty.as_bytes();
    let mut words: Vec<&str> = Vec::new();
    // Whether the last thing read was a container's name (`Dict`), whose
    // parenthesis holds types rather than alias sets.
    let mut after_container = false;
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < bytes.len()
                && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_' || bytes[i] == b'.')
            {
                i += 1;
            }
            let word = &ty[start..i];
            after_container = is_container(word);
            words.push(word);
            continue;
        }
        if c == b'(' && !after_container {
            // An alias annotation (`(a!)`, `(a -> *)`, `(b|a)`) holds alias
            // sets only: lower-case letters, `*`, `!`, `|`, `->`, spaces.
            if let Some(len) = ty[i..].find(')') {
                let inside = &ty[i + 1..i + len];
                if inside
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b" *!|->".contains(&b))
                {
                    i += len + 1;
                    continue;
                }
            }
        }
        after_container = false;
        i += 1;
    }
    words
}

fn is_container(word: &str) -> bool {
    matches!(
        word,
        "Dict" | "Future" | "RRef" | "Await" | "Union" | "Optional" | "List" | "Tuple"
    )
}

/// The first hazard among `params` of `schema`, if any (POL-3).
pub(crate) fn first_hazard(schema: &str, params: &[Param]) -> Option<Hazard> {
    params.iter().find_map(|p| {
        param_hazard(p).map(|kind| Hazard {
            kind,
            param: match &p.default {
                Some(d) => format!("{} {}={d}", p.ty, p.name),
                None => format!("{} {}", p.ty, p.name),
            },
            schema: schema.to_owned(),
        })
    })
}

/// The hazards of a whole schema: its first unsafe parameter, or an opaque
/// hazard if it does not parse.
pub(crate) fn schema_hazard(schema: &str) -> Option<Hazard> {
    match parse_params(schema) {
        Some(params) => first_hazard(schema, &params),
        None => Some(Hazard {
            kind: HazardKind::Opaque,
            param: "(unreadable schema)".into(),
            schema: schema.to_owned(),
        }),
    }
}

fn param_hazard(p: &Param) -> Option<HazardKind> {
    if p.ty == "..." {
        return Some(HazardKind::Opaque);
    }
    let words = type_words(&p.ty);
    let name = p.name.as_str();
    let optional = p.ty.contains('?');
    for word in &words {
        match *word {
            "Storage" => return Some(HazardKind::Storage),
            "Stream" => return Some(HazardKind::Stream),
            // `Generator? generator=None`: only None can fill it, and the
            // worker's own generator then runs.
            "Generator" if optional && p.default.as_deref() == Some("None") => {}
            "Generator" => return Some(HazardKind::Generator),
            w if w.starts_with("__torch__") => return Some(HazardKind::Opaque),
            w if w.ends_with(".Stream") => return Some(HazardKind::Stream),
            w if !PLAIN_TYPES.contains(&w) => return Some(HazardKind::Opaque),
            _ => {}
        }
    }
    let first = words.first().copied().unwrap_or("");
    let named_like_an_address = name.contains("ptr")
        || name.contains("address")
        || name.contains("pointer")
        || name == "addr";
    if matches!(first, "int" | "SymInt" | "int64_t") && named_like_an_address {
        return Some(HazardKind::RawPointer);
    }
    if first == "str" && FILE_PARAMS.contains(&name) {
        return Some(HazardKind::FileName);
    }
    None
}

/// What values a parameter can take, by kind, worked out once from its
/// type (POL-4: screening a call allocates nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Accepts {
    /// Any kind might convert: ask libtorch.
    Anything,
    /// A list or a tuple; one number too for a fixed-size `int[N]` or
    /// `float[N]`, which the shim repeats N times.
    Sequence {
        /// Whether one number fills it.
        number: bool,
    },
    /// No kind of our values converts (`Storage`, `Dict`, an enum, ...).
    Nothing,
}

/// A parameter as the screen needs it.
#[derive(Debug, Clone)]
struct Slot {
    name: String,
    has_default: bool,
    /// Whether `None` fills it (an optional type, `Any`, `NoneType`).
    takes_none: bool,
    accepts: Accepts,
}

impl Slot {
    fn of(p: &Param) -> Slot {
        let words = type_words(&p.ty);
        let first = words.first().copied().unwrap_or("");
        let accepts = if matches!(
            first,
            "Storage" | "Stream" | "Generator" | "Dict" | "Future" | "RRef" | "Await" | "Capsule"
        ) || first.starts_with("AnyEnum")
            || first.starts_with("__torch__")
        {
            Accepts::Nothing
        } else if let Some(open) = p.ty.find('[').filter(|_| !p.ty.starts_with('(')) {
            let fixed_size = p.ty[open + 1..].starts_with(|c: char| c.is_ascii_digit());
            Accepts::Sequence {
                number: fixed_size && matches!(first, "int" | "SymInt" | "float"),
            }
        } else {
            Accepts::Anything
        };
        Slot {
            name: p.name.clone(),
            has_default: p.default.is_some(),
            takes_none: p.ty.ends_with('?') || matches!(first, "Any" | "NoneType"),
            accepts,
        }
    }

    /// Whether `value` could convert to this parameter; `false` only where
    /// no conversion exists for any value of its kind.
    fn may_take(&self, value: &OpValue) -> bool {
        match (value, self.accepts) {
            (OpValue::None, _) => self.takes_none,
            (_, Accepts::Anything) => true,
            (_, Accepts::Nothing) => false,
            (OpValue::List(_) | OpValue::Tuple(_), Accepts::Sequence { .. }) => true,
            (OpValue::Int(_) | OpValue::Float(_), Accepts::Sequence { number }) => number,
            (_, Accepts::Sequence { .. }) => false,
        }
    }
}

/// An overload the policy withholds from a call, with what a call needs to
/// reach it.
#[derive(Debug, Clone)]
pub struct Overload {
    /// Why it is withheld.
    pub hazard: Hazard,
    /// Its parameters; `None` if the schema does not parse or takes
    /// varargs (every call could bind it then).
    slots: Option<Vec<Slot>>,
    /// How many parameters come before `*`.
    positional: usize,
    /// Whether trailing ints of a method call could fill its second
    /// parameter (`view(2, 3)`), which makes arity meaningless.
    packs_varargs: bool,
}

impl Overload {
    /// The withheld overload of `schema` (with its hazard), or `None` if
    /// `schema` has no hazard.
    pub(crate) fn withheld(schema: &str) -> Option<Overload> {
        let params = parse_params(schema);
        let hazard = match &params {
            Some(params) => first_hazard(schema, params)?,
            None => schema_hazard(schema)?,
        };
        let params = params.filter(|ps| ps.iter().all(|p| p.ty != "..."));
        let positional = params
            .as_ref()
            .map_or(0, |ps| ps.iter().take_while(|p| !p.keyword_only).count());
        let packs_varargs =
            positional == 2 && params.as_ref().is_some_and(|ps| ps[1].ty.contains('['));
        Some(Overload {
            hazard,
            slots: params.map(|ps| ps.iter().map(Slot::of).collect()),
            positional,
            packs_varargs,
        })
    }

    /// The overload's schema.
    pub fn schema(&self) -> &str {
        &self.hazard.schema
    }

    /// Whether a call with these arguments could bind this overload. Never
    /// `false` for a call libtorch would bind to it: it answers `false` only
    /// when an argument is missing or surplus, or a value's kind cannot
    /// convert to the parameter's type (a tensor to a list, anything but
    /// `None` to a type our values have no variant for). `true` means "ask
    /// libtorch" (POL-4). Allocates nothing.
    pub(crate) fn could_bind(
        &self,
        args: &[OpValue],
        kwargs: &[(String, OpValue)],
        method: bool,
    ) -> bool {
        let Some(slots) = &self.slots else {
            return true;
        };
        if method && self.packs_varargs {
            return true;
        }
        if args.len() > self.positional {
            return false;
        }
        for (i, slot) in slots.iter().enumerate() {
            let value = match args.get(i) {
                Some(v) => Some(v),
                None => kwargs.iter().find(|(k, _)| *k == slot.name).map(|(_, v)| v),
            };
            match value {
                None if !slot.has_default => return false,
                Some(v) if !slot.may_take(v) => return false,
                _ => {}
            }
        }
        kwargs
            .iter()
            .all(|(k, _)| slots.iter().skip(args.len()).any(|s| s.name == *k))
    }
}

#[cfg(test)]
mod tests;
