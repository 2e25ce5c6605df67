//! Checkpoints of a distributed job in a granted folder: each owner of
//! parameters writes its own shard, and one small manifest names the step
//! and the shards.
//!
//! The layout of a checkpoint folder (`/ckpt` below):
//!
//! ```text
//! /ckpt/checkpoint.json                   the manifest: step, shards, metadata
//! /ckpt/step-00000003/worker0.safetensors one shard per owner (safetensors)
//! ```
//!
//! A job saves a step in two phases: every owner calls [`save_shard`] (on
//! its own worker, through the grant its operator gave the plugin there),
//! then one worker calls [`commit`] with the shards. The manifest is
//! written last and atomically, so a job killed while saving leaves the
//! previous checkpoint whole; [`commit`] then removes older steps' shards
//! (and their folders) it can see on this worker. [`latest`] reads the manifest back and
//! [`load_shard`] a shard. Owners on other workers save and load their
//! shards through a function of the plugin that calls these there (the
//! folder must be shared between the workers, or each owner's shard stays
//! on its own worker's disk: the manifest names which worker wrote each).
//!
//! The manifest is JSON an operator can read:
//! `{"step": 3, "shards": {"worker0": "step-00000003/worker0.safetensors"},
//! "metadata": {"lr": "0.1"}}`.

use crate::{Error, Result, Tensor, fs, get_worker_info};

/// The manifest's file name in a checkpoint folder.
pub const MANIFEST: &str = "checkpoint.json";

/// What a checkpoint's manifest says.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Manifest {
    /// The step (an epoch, an iteration) the checkpoint was taken after.
    pub step: i64,
    /// Each shard: the worker that wrote it and its path in the folder.
    pub shards: Vec<(String, String)>,
    /// String metadata the job stored with it (hyperparameters, history).
    pub metadata: Vec<(String, String)>,
}

impl Manifest {
    /// A metadata entry by key.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.metadata
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The shard `worker` wrote.
    pub fn shard(&self, worker: &str) -> Option<&str> {
        self.shards
            .iter()
            .find(|(w, _)| w == worker)
            .map(|(_, p)| p.as_str())
    }

    fn to_json(&self) -> String {
        fn object(pairs: &[(String, String)]) -> String {
            let fields: Vec<String> = pairs
                .iter()
                .map(|(k, v)| format!("{}: {}", quote(k), quote(v)))
                .collect();
            format!("{{{}}}", fields.join(", "))
        }
        format!(
            "{{\"step\": {}, \"shards\": {}, \"metadata\": {}}}\n",
            self.step,
            object(&self.shards),
            object(&self.metadata)
        )
    }

    fn from_json(file: &str, text: &str) -> Result<Manifest> {
        let bad =
            |why: &str| Error::runtime_error(format!("{file} is not a checkpoint manifest: {why}"));
        let mut p = Parser {
            s: text.as_bytes(),
            at: 0,
        };
        let mut manifest = Manifest::default();
        let (mut step, mut shards, mut metadata) = (false, false, false);
        p.expect(b'{').map_err(|e| bad(&e))?;
        loop {
            let key = p.string().map_err(|e| bad(&e))?;
            p.expect(b':').map_err(|e| bad(&e))?;
            match key.as_str() {
                "step" => {
                    manifest.step = p.integer().map_err(|e| bad(&e))?;
                    step = true;
                }
                "shards" => {
                    manifest.shards = p.string_object().map_err(|e| bad(&e))?;
                    shards = true;
                }
                "metadata" => {
                    manifest.metadata = p.string_object().map_err(|e| bad(&e))?;
                    metadata = true;
                }
                other => return Err(bad(&format!("unknown key {other:?}"))),
            }
            if !p.next_or_end(b'}').map_err(|e| bad(&e))? {
                break;
            }
        }
        p.end().map_err(|e| bad(&e))?;
        if !(step && shards && metadata) {
            return Err(bad("it needs step, shards and metadata"));
        }
        Ok(manifest)
    }
}

/// `s` as a JSON string.
fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The little JSON the manifest uses: an object of a number and objects
/// of strings. Written by hand for this one fixed shape, so that every
/// plugin's wasm build does not carry a JSON library.
struct Parser<'a> {
    s: &'a [u8],
    at: usize,
}

impl Parser<'_> {
    fn skip_space(&mut self) {
        while self.s.get(self.at).is_some_and(u8::is_ascii_whitespace) {
            self.at += 1;
        }
    }

    fn expect(&mut self, c: u8) -> core::result::Result<(), String> {
        self.skip_space();
        if self.s.get(self.at) == Some(&c) {
            self.at += 1;
            Ok(())
        } else {
            Err(format!("expected '{}' at byte {}", c as char, self.at))
        }
    }

    /// After an item: `true` on a comma (another follows), `false` on `end`.
    fn next_or_end(&mut self, end: u8) -> core::result::Result<bool, String> {
        self.skip_space();
        match self.s.get(self.at) {
            Some(b',') => {
                self.at += 1;
                Ok(true)
            }
            Some(&c) if c == end => {
                self.at += 1;
                Ok(false)
            }
            _ => Err(format!(
                "expected ',' or '{}' at byte {}",
                end as char, self.at
            )),
        }
    }

    fn end(&mut self) -> core::result::Result<(), String> {
        self.skip_space();
        if self.at == self.s.len() {
            Ok(())
        } else {
            Err(format!("trailing text at byte {}", self.at))
        }
    }

    fn integer(&mut self) -> core::result::Result<i64, String> {
        self.skip_space();
        let start = self.at;
        if self.s.get(self.at) == Some(&b'-') {
            self.at += 1;
        }
        while self.s.get(self.at).is_some_and(u8::is_ascii_digit) {
            self.at += 1;
        }
        core::str::from_utf8(&self.s[start..self.at])
            .ok()
            .and_then(|t| t.parse().ok())
            .ok_or_else(|| format!("expected an integer at byte {start}"))
    }

    fn string(&mut self) -> core::result::Result<String, String> {
        self.expect(b'"')?;
        let mut out = Vec::new();
        loop {
            let c = *self.s.get(self.at).ok_or("an unterminated string")?;
            self.at += 1;
            match c {
                b'"' => break,
                b'\\' => {
                    let e = *self.s.get(self.at).ok_or("an unterminated escape")?;
                    self.at += 1;
                    match e {
                        b'"' | b'\\' | b'/' => out.push(e),
                        b'n' => out.push(b'\n'),
                        b'r' => out.push(b'\r'),
                        b't' => out.push(b'\t'),
                        b'u' => {
                            let hex = self
                                .s
                                .get(self.at..self.at + 4)
                                .ok_or("a short \\u escape")?;
                            self.at += 4;
                            let code = core::str::from_utf8(hex)
                                .ok()
                                .and_then(|h| u32::from_str_radix(h, 16).ok())
                                .and_then(char::from_u32)
                                .ok_or("a bad \\u escape")?;
                            out.extend_from_slice(code.encode_utf8(&mut [0; 4]).as_bytes());
                        }
                        _ => return Err(format!("a bad escape at byte {}", self.at)),
                    }
                }
                c => out.push(c),
            }
        }
        String::from_utf8(out).map_err(|_| "a string that is not UTF-8".to_owned())
    }

    fn string_object(&mut self) -> core::result::Result<Vec<(String, String)>, String> {
        self.expect(b'{')?;
        let mut pairs = Vec::new();
        self.skip_space();
        if self.s.get(self.at) == Some(&b'}') {
            self.at += 1;
            return Ok(pairs);
        }
        loop {
            let k = self.string()?;
            self.expect(b':')?;
            let v = self.string()?;
            pairs.push((k, v));
            if !self.next_or_end(b'}')? {
                return Ok(pairs);
            }
        }
    }
}

fn step_folder(step: i64) -> String {
    format!("step-{step:08}")
}

fn join(dir: &str, rest: &str) -> String {
    format!("{}/{rest}", dir.trim_end_matches('/'))
}

/// Saves this worker's shard of step `step` into the checkpoint folder
/// `dir` (`dir/step-NNNNNNNN/<worker>.safetensors`); returns `(worker,
/// path in the folder)` for [`commit`].
///
/// # Errors
/// As [`fs::save_tensors`].
pub fn save_shard(dir: &str, step: i64, tensors: &[(&str, &Tensor)]) -> Result<(String, String)> {
    let worker = get_worker_info()?.name;
    let relative = format!("{}/{worker}.safetensors", step_folder(step));
    let step_text = step.to_string();
    fs::save_tensors_with_metadata(
        &join(dir, &relative),
        tensors,
        &[("step", step_text.as_str()), ("worker", worker.as_str())],
    )?;
    Ok((worker, relative))
}

/// Makes step `step` the folder's checkpoint: writes the manifest naming
/// `shards` (from [`save_shard`]) and `metadata`, atomically, then removes
/// the shards of older steps this worker can see in `dir`.
///
/// # Errors
/// As [`fs::write`].
pub fn commit(
    dir: &str,
    step: i64,
    shards: &[(String, String)],
    metadata: &[(&str, &str)],
) -> Result<()> {
    let manifest = Manifest {
        step,
        shards: shards.to_vec(),
        metadata: metadata
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    };
    fs::write(&join(dir, MANIFEST), manifest.to_json())?;
    let keep = step_folder(step);
    for entry in fs::list(dir)? {
        if entry.is_dir && entry.name.starts_with("step-") && entry.name != keep {
            let old = join(dir, &entry.name);
            for file in fs::list(&old)? {
                if !file.is_dir {
                    fs::remove(&join(&old, &file.name))?;
                }
            }
            // Left when something else was put there.
            let _ = fs::remove(&old);
        }
    }
    Ok(())
}

/// The folder's last committed checkpoint, or `None` when it has none.
///
/// # Errors
/// As [`fs::read`], and a `RuntimeError` for a manifest that is not one.
pub fn latest(dir: &str) -> Result<Option<Manifest>> {
    let has_manifest = fs::list(dir)?
        .iter()
        .any(|e| e.name == MANIFEST && !e.is_dir);
    if !has_manifest {
        return Ok(None);
    }
    let path = join(dir, MANIFEST);
    let text = fs::read_to_string(&path)?;
    Manifest::from_json(&path, &text).map(Some)
}

/// The tensors of `worker`'s shard of the checkpoint `manifest` in `dir`.
///
/// # Errors
/// A `RuntimeError` when the manifest names no shard of `worker`; as
/// [`fs::load_tensors`].
pub fn load_shard(dir: &str, manifest: &Manifest, worker: &str) -> Result<Vec<(String, Tensor)>> {
    let shard = manifest.shard(worker).ok_or_else(|| {
        Error::runtime_error(format!(
            "the checkpoint of step {} in {dir} has no shard of {worker} (it has: {})",
            manifest.step,
            manifest
                .shards
                .iter()
                .map(|(w, _)| w.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })?;
    if shard.split('/').any(|p| p == "..") {
        return Err(Error::value_error(format!(
            "the checkpoint manifest in {dir} names a shard outside it: {shard}"
        )));
    }
    fs::load_tensors(&join(dir, shard))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifests_round_trip_through_json() {
        let m = Manifest {
            step: 3,
            shards: vec![("worker0".into(), "step-00000003/worker0.safetensors".into())],
            metadata: vec![
                ("lr".into(), "0.1".into()),
                ("odd".into(), "q\"u\\o\nte\u{1}".into()),
            ],
        };
        let json = m.to_json();
        assert_eq!(Manifest::from_json("m", &json).unwrap(), m);
    }

    #[test]
    fn bad_manifests_are_refused() {
        for text in [
            "",
            "{}",
            "{\"step\": 1}",
            "{\"step\": x, \"shards\": {}, \"metadata\": {}}",
            "{\"step\": 1, \"shards\": {}, \"metadata\": {}} trailing",
            "{\"step\": 1, \"shards\": {\"a\": 2}, \"metadata\": {}}",
            "{\"step\": 1, \"shards\": {}, \"metadata\": {}, \"extra\": 1}",
        ] {
            let e = Manifest::from_json("/ckpt/checkpoint.json", text).unwrap_err();
            assert!(
                e.message()
                    .starts_with("/ckpt/checkpoint.json is not a checkpoint manifest"),
                "{text}: {e:?}"
            );
        }
    }
}
