//! [`FileStore`]: a store in a shared file, PyTorch's `FileStore`.
//!
//! The file is an append-only log of records, each a `u32` little-endian
//! length and the key bytes, then a `u32` length and the value bytes, the
//! format PyTorch's `FileStore` writes (so both can share a file). Keys are
//! stored as `/key`; a record whose key is `-/key` deletes `key`; the
//! `cleanup/` counter tracks how many stores have been dropped.
//!
//! Invariants:
//! - FILE-1: records are only appended, under an exclusive `flock`; readers
//!   take a shared `flock`, so nobody sees half a record.
//! - FILE-2: each `FileStore` caches the map it has replayed and the file
//!   offset it replayed up to, and replays only the new tail.
//! - FILE-3: when `num_workers` is given, the store dropped last removes the
//!   file.
//!
//! Every operation runs its file I/O on tokio's blocking pool. `get` and `wait`
//! poll the file every 10 ms (no inotify: it does not work on shared file
//! systems such as NFS), as PyTorch does.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use crate::store::{
    DEFAULT_TIMEOUT, Error, Result, Store, TimeoutCell, add_to_counter, check_multi_set,
    compare_set_outcome, deadline_after, get_each,
};

const REGULAR_PREFIX: &str = "/";
const DELETE_PREFIX: &str = "-";
const CLEANUP_KEY: &str = "cleanup/";
const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// A c10d store kept in a file that several processes on one machine share.
///
/// Differs from PyTorch's in one detail: `delete_key` tells whether the key
/// existed (PyTorch's always returns true).
#[derive(Debug)]
pub struct FileStore {
    path: PathBuf,
    num_workers: Option<usize>,
    cache: Arc<Mutex<Cache>>,
    timeout: TimeoutCell,
}

/// What this store has replayed from the file (FILE-2).
#[derive(Debug, Default)]
struct Cache {
    pos: u64,
    map: HashMap<Vec<u8>, Vec<u8>>,
}

fn regular(key: &str) -> Vec<u8> {
    format!("{REGULAR_PREFIX}{key}").into_bytes()
}

fn lock(cache: &Mutex<Cache>) -> MutexGuard<'_, Cache> {
    // The cache is only replaced wholesale by `refresh`; a panic elsewhere
    // leaves it consistent.
    cache.lock().unwrap_or_else(|e| e.into_inner())
}

/// One open, locked view of the file; the `flock` is released on drop.
struct Locked {
    file: File,
    path: PathBuf,
}

impl Locked {
    fn open(path: &Path, exclusive: bool) -> Result<Option<Self>> {
        let opened = if exclusive {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)
        } else {
            File::open(path)
        };
        let file = match opened {
            Ok(file) => file,
            Err(e) if !exclusive && e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(format!("open({})", path.display()), e)),
        };
        let locked = if exclusive {
            file.lock()
        } else {
            file.lock_shared()
        };
        locked.map_err(|e| Error::io(format!("flock({})", path.display()), e))?;
        Ok(Some(Self {
            file,
            path: path.to_owned(),
        }))
    }

    fn size(&self) -> Result<u64> {
        self.file
            .metadata()
            .map(|m| m.len())
            .map_err(|e| self.err("stat", e))
    }

    fn err(&self, what: &str, e: std::io::Error) -> Error {
        Error::io(format!("{what}({})", self.path.display()), e)
    }

    /// Replays the records after `cache.pos` (FILE-2).
    fn refresh(&mut self, cache: &mut Cache) -> Result<()> {
        let size = self.size()?;
        if size == cache.pos {
            return Ok(());
        }
        if size < cache.pos {
            return Err(Error::Protocol(format!(
                "file store {} shrank from {} to {size} bytes",
                self.path.display(),
                cache.pos
            )));
        }
        self.file
            .seek(SeekFrom::Start(cache.pos))
            .map_err(|e| self.err("lseek", e))?;
        let mut reader = BufReader::new(&self.file).take(size - cache.pos);
        let mut pos = cache.pos;
        while pos < size {
            let key = read_field(&mut reader, &self.path, pos)?;
            let value = read_field(&mut reader, &self.path, pos)?;
            pos += 8 + key.len() as u64 + value.len() as u64;
            match key.strip_prefix(DELETE_PREFIX.as_bytes()) {
                Some(deleted) => {
                    cache.map.remove(deleted);
                }
                None => {
                    cache.map.insert(key, value);
                }
            }
        }
        cache.pos = pos;
        Ok(())
    }

    /// Appends records (FILE-1: the caller holds the exclusive lock).
    fn append(&mut self, records: &[(&[u8], &[u8])]) -> Result<()> {
        let mut buf = Vec::new();
        for (key, value) in records {
            for field in [key, value] {
                let len = u32::try_from(field.len()).map_err(|_| {
                    Error::InvalidArgument(format!(
                        "file store field of {} bytes exceeds the u32 record limit",
                        field.len()
                    ))
                })?;
                buf.extend_from_slice(&len.to_le_bytes());
                buf.extend_from_slice(field);
            }
        }
        self.file
            .seek(SeekFrom::End(0))
            .map_err(|e| self.err("lseek", e))?;
        self.file.write_all(&buf).map_err(|e| self.err("write", e))
    }
}

fn read_field(reader: &mut impl Read, path: &Path, pos: u64) -> Result<Vec<u8>> {
    let corrupt = |e: std::io::Error| {
        Error::Protocol(format!(
            "file store {} has a truncated record at offset {pos}: {e}",
            path.display()
        ))
    };
    let mut len = [0u8; 4];
    reader.read_exact(&mut len).map_err(corrupt)?;
    let len = u32::from_le_bytes(len) as usize;
    let mut field = Vec::with_capacity(len.min(1 << 20));
    reader
        .take(len as u64)
        .read_to_end(&mut field)
        .map_err(corrupt)?;
    if field.len() != len {
        return Err(corrupt(std::io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(field)
}

impl FileStore {
    /// A store in the file at `path` (created on first write).
    ///
    /// `num_workers` is the number of stores (usually processes) that share
    /// the file; when given, the last of them to be dropped removes the file
    /// (FILE-3). PyTorch's `FileStore(path, world_size)`.
    pub fn new(path: impl Into<PathBuf>, num_workers: Option<usize>) -> Self {
        Self {
            path: path.into(),
            num_workers,
            cache: Arc::new(Mutex::new(Cache::default())),
            timeout: TimeoutCell::new(DEFAULT_TIMEOUT),
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on the blocking pool with the file open and locked, and the
    /// cache refreshed when `refresh` is set. `Ok(None)` when the file does
    /// not exist yet and a shared lock was asked for.
    async fn with_file<T: Send + 'static>(
        &self,
        exclusive: bool,
        f: impl FnOnce(&mut Locked, &mut Cache) -> Result<T> + Send + 'static,
    ) -> Result<Option<T>> {
        let path = self.path.clone();
        let cache = Arc::clone(&self.cache);
        tokio::task::spawn_blocking(move || {
            let mut cache = lock(&cache);
            let Some(mut file) = Locked::open(&path, exclusive)? else {
                return Ok(None);
            };
            file.refresh(&mut cache)?;
            f(&mut file, &mut cache).map(Some)
        })
        .await
        .map_err(|e| Error::io("file store task", std::io::Error::other(e)))?
    }

    async fn present(&self, keys: &[&str]) -> Result<Vec<String>> {
        let wanted: Vec<(String, Vec<u8>)> =
            keys.iter().map(|k| ((*k).to_owned(), regular(k))).collect();
        let missing = self
            .with_file(false, move |_, cache| {
                Ok(wanted
                    .into_iter()
                    .filter(|(_, reg)| !cache.map.contains_key(reg))
                    .map(|(k, _)| k)
                    .collect::<Vec<_>>())
            })
            .await?;
        Ok(missing.unwrap_or_else(|| keys.iter().map(|k| (*k).to_owned()).collect()))
    }

    async fn wait_for(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let deadline = deadline_after(timeout);
        loop {
            let missing = self.present(keys).await?;
            if missing.is_empty() {
                return Ok(());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Error::Timeout {
                    keys: missing,
                    timeout,
                });
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    fn add_blocking(path: &Path, cache: &Mutex<Cache>, key: Vec<u8>, delta: i64) -> Result<i64> {
        let mut cache = lock(cache);
        let Some(mut file) = Locked::open(path, true)? else {
            return Err(Error::Protocol("exclusive open returned no file".into()));
        };
        file.refresh(&mut cache)?;
        let name = String::from_utf8_lossy(&key).into_owned();
        let new = add_to_counter(&name, cache.map.get(&key).map(Vec::as_slice), delta)?;
        let text = new.to_string().into_bytes();
        file.append(&[(&key, &text)])?;
        file.refresh(&mut cache)?;
        Ok(new)
    }
}

impl Drop for FileStore {
    fn drop(&mut self) {
        // FILE-3, as PyTorch's destructor: count this store as finished and
        // let the last one remove the file. Nothing to do if it is gone.
        if !self.path.exists() {
            return;
        }
        match Self::add_blocking(&self.path, &self.cache, CLEANUP_KEY.as_bytes().to_vec(), 1) {
            Ok(finished) => {
                if self
                    .num_workers
                    .is_some_and(|n| usize::try_from(finished).is_ok_and(|f| f == n))
                {
                    let _ = std::fs::remove_file(&self.path);
                }
            }
            Err(e) => {
                tracing::debug!(path = %self.path.display(), error = %e, "file store cleanup failed")
            }
        }
    }
}

fn exclusive<T>(result: Option<T>) -> Result<T> {
    result.ok_or_else(|| Error::Protocol("exclusive open returned no file".into()))
}

#[async_trait::async_trait]
impl Store for FileStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let (key, value) = (regular(key), value.to_vec());
        exclusive(
            self.with_file(true, move |f, _| f.append(&[(&key, &value)]))
                .await?,
        )
    }

    async fn get(&self, key: &str) -> Result<Vec<u8>> {
        let timeout = self.timeout();
        let deadline = deadline_after(timeout);
        let reg = regular(key);
        loop {
            let reg = reg.clone();
            let found = self
                .with_file(false, move |_, cache| Ok(cache.map.get(&reg).cloned()))
                .await?
                .flatten();
            if let Some(value) = found {
                return Ok(value);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Error::Timeout {
                    keys: vec![key.to_owned()],
                    timeout,
                });
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let path = self.path.clone();
        let cache = Arc::clone(&self.cache);
        let key = regular(key);
        tokio::task::spawn_blocking(move || Self::add_blocking(&path, &cache, key, delta))
            .await
            .map_err(|e| Error::io("file store task", std::io::Error::other(e)))?
    }

    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let (key, expected, desired) = (regular(key), expected.to_vec(), desired.to_vec());
        exclusive(
            self.with_file(true, move |f, cache| {
                let (store, ret) = compare_set_outcome(
                    cache.map.get(&key).map(Vec::as_slice),
                    &expected,
                    &desired,
                );
                if let Some(value) = store {
                    f.append(&[(&key, &value)])?;
                }
                Ok(ret)
            })
            .await?,
        )
    }

    async fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.wait_for(keys, timeout).await
    }

    async fn check(&self, keys: &[&str]) -> Result<bool> {
        Ok(self.present(keys).await?.is_empty())
    }

    async fn delete_key(&self, key: &str) -> Result<bool> {
        let reg = regular(key);
        exclusive(
            self.with_file(true, move |f, cache| {
                let existed = cache.map.contains_key(&reg);
                let mut tombstone = DELETE_PREFIX.as_bytes().to_vec();
                tombstone.extend_from_slice(&reg);
                f.append(&[(&tombstone, &[])])?;
                Ok(existed)
            })
            .await?,
        )
    }

    async fn num_keys(&self) -> Result<i64> {
        let n = self
            .with_file(false, |_, cache| Ok(cache.map.len()))
            .await?
            .unwrap_or(0);
        Ok(i64::try_from(n).unwrap_or(i64::MAX))
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        let (key, value) = (regular(key), value.to_vec());
        exclusive(
            self.with_file(true, move |f, cache| {
                let mut new = cache.map.get(&key).cloned().unwrap_or_default();
                new.extend_from_slice(&value);
                f.append(&[(&key, &new)])
            })
            .await?,
        )
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        get_each(self, keys).await
    }

    async fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<()> {
        check_multi_set(keys, values)?;
        let records: Vec<(Vec<u8>, Vec<u8>)> = keys
            .iter()
            .zip(values)
            .map(|(k, v)| (regular(k), v.to_vec()))
            .collect();
        exclusive(
            self.with_file(true, move |f, _| {
                let refs: Vec<(&[u8], &[u8])> = records
                    .iter()
                    .map(|(k, v)| (k.as_slice(), v.as_slice()))
                    .collect();
                f.append(&refs)
            })
            .await?,
        )
    }

    fn timeout(&self) -> Duration {
        self.timeout.get()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.timeout.set(timeout);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_tombstones_delete() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store");
        let mut cache = Cache::default();
        {
            let mut f = Locked::open(&path, true).unwrap().unwrap();
            f.append(&[(b"/a", b"1"), (b"/b", b"22")]).unwrap();
            f.append(&[(b"-/a", b"")]).unwrap();
            f.refresh(&mut cache).unwrap();
        }
        assert_eq!(cache.map.len(), 1);
        assert_eq!(cache.map[b"/b".as_slice()], b"22");
        // Exactly PyTorch's layout: u32 LE length, bytes, twice per record.
        let raw = std::fs::read(&path).unwrap();
        assert_eq!(&raw[..8], &[2, 0, 0, 0, b'/', b'a', 1, 0]);
        assert_eq!(cache.pos, raw.len() as u64);
    }

    #[test]
    fn truncated_record_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store");
        std::fs::write(&path, [5u8, 0, 0, 0, b'x']).unwrap();
        let mut f = Locked::open(&path, false).unwrap().unwrap();
        let err = f.refresh(&mut Cache::default()).unwrap_err();
        assert!(err.to_string().contains("truncated"), "{err}");
    }
}
