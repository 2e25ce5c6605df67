//! numpy's `.npz` format: a zip of `.npy` members, stored (`np.savez`) or
//! deflated (`np.savez_compressed`).
//!
//! The zip may be a bomb: each member is inflated through [`npy`]'s
//! reader, which reads its header, then only the data bytes the header
//! declares, after the declared size has been checked against what is
//! left of the caller's limit.

use std::collections::BTreeSet;
use std::io::Cursor;

use zip::CompressionMethod;
use zip::ZipArchive;
use zip::result::ZipError;

use crate::{FileError, Format, TensorBytes, npy};

/// The most members an archive may have; each costs a directory entry and
/// a tensor, and no real `.npz` comes close.
pub(crate) const MAX_MEMBERS: usize = 65_536;

fn malformed(file: &str, reason: impl Into<String>) -> FileError {
    FileError::Malformed {
        file: file.to_owned(),
        format: Format::Npz,
        reason: reason.into(),
    }
}

/// What a `.npz` member other than plain `.npy` data may be read as.
const MEMBERS: &str = "an .npz archive holds only .npy members, stored or deflated, unencrypted";

/// Reads every member of an archive, in the archive's order.
///
/// `pickle_extension` says the file's name ends in `.pt`, `.pth`, ...:
/// a zip under such a name that is not an `.npz` is taken for a PyTorch
/// checkpoint and refused as a pickle.
pub(crate) fn read(
    file: &str,
    bytes: &[u8],
    limit: u64,
    pickle_extension: bool,
) -> Result<Vec<(String, TensorBytes)>, FileError> {
    let mut archive = ZipArchive::new(Cursor::new(bytes))
        .map_err(|error| malformed(file, format!("it is not a readable zip archive ({error})")))?;
    if archive.len() > MAX_MEMBERS {
        return Err(malformed(
            file,
            format!(
                "it has {} members, over the {MAX_MEMBERS} allowed",
                archive.len()
            ),
        ));
    }
    // `torch.save` writes a zip whose pickle is `<name>/data.pkl`; refuse
    // it as a pickle before complaining about anything else.
    let is_pickle = |name: &str| name == "data.pkl" || name.ends_with("/data.pkl");
    if archive.file_names().any(is_pickle) {
        return Err(FileError::Pickle {
            file: file.to_owned(),
        });
    }

    let mut names = BTreeSet::new();
    let mut tensors = Vec::new();
    let mut used: u64 = 0;
    for index in 0..archive.len() {
        let member = match archive.by_index(index) {
            Ok(member) => member,
            Err(ZipError::UnsupportedArchive(message))
                if message == ZipError::PASSWORD_REQUIRED =>
            {
                return Err(FileError::Unsupported {
                    file: file.to_owned(),
                    what: format!("an encrypted member (number {index})"),
                    supported: MEMBERS,
                });
            }
            Err(error) => {
                return Err(malformed(
                    file,
                    format!("its member number {index} is unreadable ({error})"),
                ));
            }
        };
        let name = member.name().to_owned();
        let Some(key) = name.strip_suffix(".npy") else {
            if pickle_extension || name.ends_with(".pkl") {
                return Err(FileError::Pickle {
                    file: file.to_owned(),
                });
            }
            return Err(FileError::Unsupported {
                file: file.to_owned(),
                what: format!("the member \"{}\" (not a .npy file)", name.escape_debug()),
                supported: MEMBERS,
            });
        };
        if !matches!(
            member.compression(),
            CompressionMethod::Stored | CompressionMethod::Deflated
        ) {
            return Err(FileError::Unsupported {
                file: file.to_owned(),
                what: format!(
                    "the compression {} for member \"{}\"",
                    member.compression(),
                    name.escape_debug()
                ),
                supported: MEMBERS,
            });
        }
        if !names.insert(key.to_owned()) {
            return Err(malformed(
                file,
                format!("it has two members named \"{}\"", name.escape_debug()),
            ));
        }
        // Messages about a member name both the archive and the member.
        let member_file = format!("{file} member \"{}\"", name.escape_debug());
        let mut member = member;
        let header = npy::read_header(&member_file, &mut member)?;
        let remaining = limit.saturating_sub(used);
        if header.data_len as u64 > remaining {
            return Err(FileError::LimitExceeded {
                file: file.to_owned(),
                limit,
            });
        }
        let tensor = npy::read_data(&member_file, &mut member, &header)?;
        used += tensor.data.len() as u64;
        tensors.push((key.to_owned(), tensor));
    }
    Ok(tensors)
}
