//! The guide (`docs/`, an mdBook): `cargo xtask docs`, and a step of
//! `cargo xtask test`. Builds the book with mdbook (installed by the set-up,
//! `setup::ensure_mdbook`) into `target/book/`, then checks the links of
//! every markdown file in the repository.
//!
//! The link check reads every `.md` file outside hidden folders and
//! `target/`: `README.md`, the guide's chapters (`docs/src/`) and the
//! others. A link with a scheme (`https:`, `mailto:`) is not followed; any
//! other link must name a file or folder that exists, relative to the file
//! it is in. No link may leave the repository, and a link from a chapter
//! must stay inside `docs/src/`: the book is published without the rest of
//! the repository (a chapter shows a repository file by including it,
//! `{{#include ../../tests/SEED_COVERAGE.md}}`, and such includes must name
//! files that exist). A `#anchor` must name a heading of the markdown file
//! it points into (or of the same file), by mdbook's rule for heading ids,
//! which GitHub's matches for the headings used here. No markdown file may
//! name `../shared`: the project's notes beside the checkout are not part of
//! the repository.

use std::collections::{HashMap, HashSet};
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};

use crate::{coverage, process, setup};

/// The guide's sources, from the repository root.
const BOOK_SRC: &str = "docs/src";

/// Builds the guide into `target/book/` and checks every markdown link;
/// fails listing the links that do not resolve.
pub(crate) fn run(root: &Path) -> Result<()> {
    let mdbook = setup::ensure_mdbook()?;
    let dest = coverage::target_dir(root).join("book");
    process::run(
        Command::new(&mdbook)
            .arg("build")
            .arg(root.join("docs"))
            .arg("--dest-dir")
            .arg(&dest),
    )
    .context("mdbook could not build the guide (docs/)")?;
    println!(
        "docs: the guide is in {}",
        dest.join("index.html").display()
    );

    let report = check_links(root)?;
    if !report.broken.is_empty() {
        for b in &report.broken {
            eprintln!("{}:{}: {}: {}", b.file.display(), b.line, b.link, b.why);
        }
        bail!(
            "{} broken link(s) in the repository's markdown files (listed above)",
            report.broken.len()
        );
    }
    println!(
        "docs: {} links and includes in {} markdown files, every one resolves",
        report.links, report.files
    );
    Ok(())
}

/// What the link check found.
#[derive(Debug, Default)]
pub(crate) struct Report {
    /// Markdown files read.
    pub(crate) files: usize,
    /// Links and includes checked (external links are not counted).
    pub(crate) links: usize,
    /// Those that do not resolve.
    pub(crate) broken: Vec<Broken>,
}

/// A link that does not resolve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Broken {
    /// The file holding it, from the repository root.
    pub(crate) file: PathBuf,
    /// Its line (from 1).
    pub(crate) line: usize,
    /// The link as written.
    pub(crate) link: String,
    /// Why it does not resolve.
    pub(crate) why: String,
}

/// Checks the links of every markdown file under `root` (see the module
/// docs for the rules).
///
/// # Errors
/// A folder or file that cannot be read.
pub(crate) fn check_links(root: &Path) -> Result<Report> {
    let mut files = Vec::new();
    markdown_files(root, &mut files)?;
    files.sort();
    let mut checker = Checker {
        root,
        book: root.join(BOOK_SRC),
        ids: HashMap::new(),
        report: Report::default(),
    };
    for file in &files {
        checker.check_file(file)?;
    }
    checker.report.files = files.len();
    Ok(checker.report)
}

/// Every `.md` file under `dir`, skipping hidden folders, `target/` folders
/// and symbolic links (`.wasmrpc-env/` links to whole Python environments).
fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let entries = std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))?;
    for entry in entries {
        let entry = entry?;
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let kind = entry.file_type()?;
        if kind.is_dir() {
            // Build outputs (`target/` at the root, and in a plugin crate
            // built on its own) hold no markdown of the repository's.
            let skipped = name.starts_with('.')
                || name == "__pycache__"
                || name == "node_modules"
                || name == "target";
            if !skipped {
                markdown_files(&path, out)?;
            }
        } else if kind.is_file() && name.ends_with(".md") {
            out.push(path);
        }
    }
    Ok(())
}

struct Checker<'a> {
    root: &'a Path,
    /// `docs/src`, whose files may link only inside it.
    book: PathBuf,
    /// Heading ids of the markdown files read so far.
    ids: HashMap<PathBuf, HashSet<String>>,
    report: Report,
}

impl Checker<'_> {
    fn check_file(&mut self, file: &Path) -> Result<()> {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let in_book = file.starts_with(&self.book);
        let dir = file.parent().unwrap_or(self.root).to_path_buf();
        let mut found = Vec::new();
        for (offset, link) in links(&text) {
            found.push((line_of(&text, offset), link, false));
        }
        if in_book {
            for (offset, path) in includes(&text) {
                found.push((line_of(&text, offset), path, true));
            }
        }
        if let Some(offset) = text.find("../shared") {
            self.broken(
                file,
                line_of(&text, offset),
                "../shared",
                "names the notes beside the checkout, which are not part of the repository",
            );
        }
        for (line, link, include) in found {
            if has_scheme(&link) {
                continue;
            }
            self.report.links += 1;
            let why = if include {
                self.check_include(&dir, &link)
            } else {
                self.check_link(file, &dir, in_book, &link)?
            };
            if let Some(why) = why {
                self.broken(file, line, &link, &why);
            }
        }
        Ok(())
    }

    /// Why `link` in `file` does not resolve, or `None` when it does.
    fn check_link(
        &mut self,
        file: &Path,
        dir: &Path,
        in_book: bool,
        link: &str,
    ) -> Result<Option<String>> {
        let (path, anchor) = match link.split_once('#') {
            Some((p, a)) => (p, Some(a)),
            None => (link, None),
        };
        let target = if path.is_empty() {
            file.to_path_buf()
        } else {
            if path.starts_with('/') {
                return Ok(Some("an absolute path: links must be relative".into()));
            }
            let Some(target) = normalize(&dir.join(path)) else {
                return Ok(Some("leaves the repository".into()));
            };
            if !target.starts_with(self.root) {
                return Ok(Some("leaves the repository".into()));
            }
            if in_book && !target.starts_with(&self.book) {
                return Ok(Some(format!(
                    "leaves the guide's sources ({BOOK_SRC}), which are published without the \
                     rest of the repository: include the file or name it as code"
                )));
            }
            if !target.exists() {
                return Ok(Some("no such file or folder".into()));
            }
            target
        };
        let Some(anchor) = anchor.filter(|a| !a.is_empty()) else {
            return Ok(None);
        };
        if target.extension().is_none_or(|e| e != "md") {
            return Ok(Some("an anchor into a file that is not markdown".into()));
        }
        let ids = self.ids_of(&target)?;
        Ok((!ids.contains(anchor)).then(|| {
            format!(
                "no heading with id `{anchor}` in {}",
                target.strip_prefix(self.root).unwrap_or(&target).display()
            )
        }))
    }

    /// Why the include of `path` (from a chapter in `dir`) does not
    /// resolve, or `None` when it does.
    fn check_include(&self, dir: &Path, path: &str) -> Option<String> {
        match normalize(&dir.join(path)) {
            Some(t) if !t.starts_with(self.root) => Some("leaves the repository".into()),
            Some(t) if t.is_file() => None,
            Some(_) => Some("no such file".into()),
            None => Some("leaves the repository".into()),
        }
    }

    /// The heading ids of markdown file `path` (a chapter's includes
    /// spliced in, as mdbook renders them).
    fn ids_of(&mut self, path: &Path) -> Result<&HashSet<String>> {
        if !self.ids.contains_key(path) {
            let mut text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            if path.starts_with(&self.book) {
                let dir = path.parent().unwrap_or(self.root);
                let included: Vec<String> = includes(&text)
                    .into_iter()
                    .filter_map(|(_, include)| std::fs::read_to_string(dir.join(include)).ok())
                    .collect();
                for part in included {
                    text.push('\n');
                    text.push_str(&part);
                }
            }
            self.ids.insert(path.to_path_buf(), heading_ids(&text));
        }
        Ok(&self.ids[path])
    }

    fn broken(&mut self, file: &Path, line: usize, link: &str, why: &str) {
        self.report.broken.push(Broken {
            file: file.strip_prefix(self.root).unwrap_or(file).to_path_buf(),
            line,
            link: link.to_string(),
            why: why.to_string(),
        });
    }
}

/// The parser options mdbook 0.5 renders with (its defaults, less smart
/// punctuation, which `docs/book.toml` turns off so that `--flag` in prose
/// stays two hyphens).
fn options() -> Options {
    Options::ENABLE_TABLES
        | Options::ENABLE_FOOTNOTES
        | Options::ENABLE_STRIKETHROUGH
        | Options::ENABLE_TASKLISTS
        | Options::ENABLE_HEADING_ATTRIBUTES
        | Options::ENABLE_DEFINITION_LIST
        | Options::ENABLE_GFM
}

/// The destination of every link and image in `text`, with its byte
/// offset. Text in code spans and code blocks is not a link.
fn links(text: &str) -> Vec<(usize, String)> {
    Parser::new_ext(text, options())
        .into_offset_iter()
        .filter_map(|(event, range)| match event {
            Event::Start(Tag::Link { dest_url, .. } | Tag::Image { dest_url, .. }) => {
                Some((range.start, dest_url.to_string()))
            }
            _ => None,
        })
        .collect()
}

/// The path of every `{{#include PATH}}` in `text` (without a `:anchor`
/// or line range), with its byte offset; an escaped `\{{#include` is text.
fn includes(text: &str) -> Vec<(usize, String)> {
    const OPEN: &str = "{{#include ";
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = text[from..].find(OPEN).map(|i| i + from) {
        from = at + OPEN.len();
        if text[..at].ends_with('\\') {
            continue;
        }
        let Some(end) = text[from..].find("}}") else {
            break;
        };
        let spec = text[from..from + end].trim();
        let path = spec.split(':').next().unwrap_or(spec);
        out.push((at, path.to_string()));
    }
    out
}

/// The ids mdbook gives the headings (and definition-list terms) of
/// `text`: an explicit `{#id}` as written; otherwise the heading's text,
/// lowercased, letters, digits, `_` and `-` kept, whitespace turned into
/// `-`, everything else dropped, and `-1`, `-2`, ... added to repeats.
fn heading_ids(text: &str) -> HashSet<String> {
    let mut ids = HashSet::new();
    let mut generated = HashSet::new();
    let mut current: Option<String> = None;
    for event in Parser::new_ext(text, options()) {
        match event {
            Event::Start(Tag::Heading { id: Some(id), .. }) => {
                ids.insert(id.to_string());
            }
            Event::Start(Tag::Heading { id: None, .. } | Tag::DefinitionListTitle) => {
                current = Some(String::new());
            }
            Event::Text(t) | Event::Code(t) => {
                if let Some(c) = current.as_mut() {
                    c.push_str(&t);
                }
            }
            Event::End(TagEnd::Heading(_) | TagEnd::DefinitionListTitle) => {
                if let Some(content) = current.take() {
                    let id = unique_id(&id_from_content(&content), &mut generated);
                    ids.insert(id);
                }
            }
            _ => {}
        }
    }
    ids
}

/// mdbook's id of a heading's text (`mdbook-html`'s `id_from_content`).
fn id_from_content(content: &str) -> String {
    content
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c)
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

/// `id`, or `id-1`, `id-2`, ... when already used (mdbook's `unique_id`).
fn unique_id(id: &str, used: &mut HashSet<String>) -> String {
    if used.insert(id.to_string()) {
        return id.to_string();
    }
    (1..)
        .map(|n| format!("{id}-{n}"))
        .find(|candidate| used.insert(candidate.clone()))
        .unwrap_or_default()
}

/// Whether `link` names a scheme (`https:`, `mailto:`): not a file.
fn has_scheme(link: &str) -> bool {
    link.split_once(':').is_some_and(|(scheme, _)| {
        !scheme.is_empty()
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    })
}

/// `path` with `.` and `..` taken out, without touching the file system;
/// `None` when `..` climbs above the file system's root.
fn normalize(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    Some(out)
}

/// The line (from 1) of byte `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A repository with a README and a guide, as files under a temp dir.
    fn repo(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("a temp dir");
        for (path, text) in files {
            let path = dir.path().join(path);
            std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir");
            std::fs::write(path, text).expect("write");
        }
        dir
    }

    fn broken(dir: &tempfile::TempDir) -> Vec<(String, usize, String)> {
        let report = check_links(dir.path()).expect("the check runs");
        report
            .broken
            .into_iter()
            .map(|b| (b.file.display().to_string(), b.line, b.link))
            .collect()
    }

    #[test]
    fn a_link_to_a_missing_file_is_broken_and_others_pass() {
        let dir = repo(&[
            (
                "README.md",
                "# wasmrpc\n\nSee [the guide](docs/src/intro.md) and [a gone page](docs/src/gone.md).\n\
                 [The web](https://example.org/missing.md) is not followed.\n",
            ),
            (
                "docs/src/intro.md",
                "# Intro\n\n[Back](../../README.md) is outside.\n",
            ),
        ]);
        assert_eq!(
            broken(&dir),
            vec![
                ("README.md".into(), 3, "docs/src/gone.md".into()),
                ("docs/src/intro.md".into(), 3, "../../README.md".into()),
            ]
        );
        let report = check_links(dir.path()).expect("the check runs");
        assert_eq!(report.files, 2);
        assert_eq!(report.links, 3);
        assert!(report.broken[1].why.contains("leaves the guide's sources"));
    }

    #[test]
    fn anchors_must_name_a_heading_by_mdbooks_ids() {
        let dir = repo(&[
            (
                "docs/src/a.md",
                "# Running a cluster\n\n## `wasmrpc launch`: a local cluster\n\n## Notes\n\n## Notes\n\n\
             ## Custom {#mine}\n\n\
             [ok](#running-a-cluster) [ok](#wasmrpc-launch-a-local-cluster) [ok](#notes-1)\n\
             [ok](a.md#mine) [ok](b.md#whats-here) [bad](#notes-2) [bad](b.md#gone)\n\
             `[not a link](missing.md)`\n\n```\n[nor this](missing.md)\n```\n",
            ),
            ("docs/src/b.md", "# What's here\n"),
        ]);
        assert_eq!(
            broken(&dir),
            vec![
                ("docs/src/a.md".into(), 12, "#notes-2".into()),
                ("docs/src/a.md".into(), 12, "b.md#gone".into()),
            ]
        );
    }

    #[test]
    fn includes_must_exist_and_their_headings_count() {
        let dir = repo(&[
            (
                "docs/src/status.md",
                "{{#include ../../tests/COVERAGE.md}}\n\n{{#include ../../tests/GONE.md:2:4}}\n\n\
                 \\{{#include not/an/include.md}}\n",
            ),
            ("docs/src/other.md", "[totals](status.md#totals)\n"),
            ("tests/COVERAGE.md", "# Coverage\n\n## Totals\n"),
        ]);
        assert_eq!(
            broken(&dir),
            vec![("docs/src/status.md".into(), 3, "../../tests/GONE.md".into())]
        );
    }

    #[test]
    fn links_may_not_leave_the_repository_nor_name_the_shared_notes() {
        let dir = repo(&[(
            "README.md",
            "[up](../elsewhere.md) [abs](/etc/passwd)\n\nSee `../shared/DESIGN.md`.\n",
        )]);
        let found = check_links(dir.path()).expect("the check runs").broken;
        let whys: Vec<(&str, &str)> = found
            .iter()
            .map(|b| (b.link.as_str(), b.why.as_str()))
            .collect();
        assert_eq!(
            whys,
            vec![
                (
                    "../shared",
                    "names the notes beside the checkout, which are not part of the repository"
                ),
                ("../elsewhere.md", "leaves the repository"),
                ("/etc/passwd", "an absolute path: links must be relative"),
            ]
        );
    }

    #[test]
    fn ids_follow_mdbook() {
        assert_eq!(
            id_from_content("`--passes`: add more rustdoc passes"),
            "--passes-add-more-rustdoc-passes"
        );
        assert_eq!(
            id_from_content("What works / what doesn't yet"),
            "what-works--what-doesnt-yet"
        );
        let mut used = HashSet::new();
        assert_eq!(unique_id("a", &mut used), "a");
        assert_eq!(unique_id("a", &mut used), "a-1");
        assert_eq!(unique_id("a", &mut used), "a-2");
        assert!(has_scheme("https://example.org"));
        assert!(has_scheme("mailto:someone@example.org"));
        assert!(!has_scheme("docs/src/a.md#x:y"));
        assert!(!has_scheme("#anchor"));
    }
}
