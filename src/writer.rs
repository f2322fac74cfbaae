//! What the two checkpoint writers (`synth`, `convert`) share: a directory written atomically
//! (a staging directory beside the target, renamed into place when complete and removed on any
//! error), safetensors shards as mlx-lm and transformers split them, JSON formatted as Python's
//! `json.dump` writes it, and row-parallel filling of a tensor's bytes.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use safetensors::{SafeTensorError, View};
use serde_json::Value;

/// Tensors smaller than this are filled on the calling thread.
pub(crate) const PARALLEL_MIN_BYTES: usize = 1 << 22;

/// A problem writing a checkpoint directory. Every variant names the path.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("output directory {0} exists and is not empty: refusing to overwrite it")]
    OutDirNotEmpty(PathBuf),
    #[error("output path {0} exists and is not a directory")]
    OutPathNotDir(PathBuf),
    #[error("output path {0} has no final component to name the directory")]
    NoFileName(PathBuf),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("writing {path}: {source}")]
    Safetensors {
        path: PathBuf,
        #[source]
        source: SafeTensorError,
    },
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> WriteError + '_ {
    move |source| WriteError::Io { path: path.to_path_buf(), source }
}

/// Ok when `out_dir` does not exist or is an empty directory (what may be filled).
pub(crate) fn check_out_dir(out_dir: &Path) -> Result<(), WriteError> {
    match fs::metadata(out_dir) {
        Ok(m) if !m.is_dir() => Err(WriteError::OutPathNotDir(out_dir.to_path_buf())),
        Ok(_) => match fs::read_dir(out_dir).map_err(io_err(out_dir))?.next() {
            Some(_) => Err(WriteError::OutDirNotEmpty(out_dir.to_path_buf())),
            None => Ok(()),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(WriteError::Io { path: out_dir.to_path_buf(), source }),
    }
}

/// A directory being written beside its final place: removed on drop unless
/// [`Staging::commit`] renamed it into place, so an error leaves nothing half-written.
pub(crate) struct Staging {
    path: PathBuf,
    out_dir: PathBuf,
    armed: bool,
}

impl Staging {
    /// Checks `out_dir` (absent or empty) and creates `.NAME.TAG-PID-NANOS` in its parent (the
    /// same file system, so the final rename is atomic).
    pub(crate) fn new(out_dir: &Path, tag: &str) -> Result<Self, WriteError> {
        check_out_dir(out_dir)?;
        let name = out_dir.file_name().ok_or_else(|| WriteError::NoFileName(out_dir.to_path_buf()))?;
        let parent = match out_dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        fs::create_dir_all(&parent).map_err(io_err(&parent))?;
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let path = parent.join(format!(".{}.{tag}-{}-{nanos}", name.to_string_lossy(), std::process::id()));
        fs::create_dir(&path).map_err(io_err(&path))?;
        Ok(Self { path, out_dir: out_dir.to_path_buf(), armed: true })
    }

    /// The staging directory to write into.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Moves the finished directory into place.
    pub(crate) fn commit(mut self) -> Result<(), WriteError> {
        if self.out_dir.exists() {
            // Checked empty in `new`; rename(2) would replace an empty directory too, but not on Windows.
            fs::remove_dir(&self.out_dir).map_err(io_err(&self.out_dir))?;
        }
        fs::rename(&self.path, &self.out_dir).map_err(io_err(&self.out_dir))?;
        self.armed = false;
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.armed {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// Writes one safetensors file (tensors in the writer's order, `metadata` in its header) with a
/// download's usual mode.
pub(crate) fn write_safetensors<V: View>(views: Vec<(String, V)>, metadata: HashMap<String, String>, path: &Path) -> Result<(), WriteError> {
    safetensors::serialize_to_file(views, Some(metadata), path).map_err(|source| WriteError::Safetensors { path: path.to_path_buf(), source })?;
    // The writer's temporary file is created 0600.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(path, fs::Permissions::from_mode(0o644)).map_err(io_err(path))?;
    }
    Ok(())
}

/// Splits tensors of `sizes` bytes (in file order) into shards the way mlx-lm's `make_shards` and
/// transformers' `shard_checkpoint` do: start a new shard when the next tensor would pass `limit`.
pub(crate) fn shards(sizes: &[u64], limit: u64) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0u64;
    for (i, &n) in sizes.iter().enumerate() {
        if size + n > limit && !out.last().is_some_and(Vec::is_empty) {
            out.push(Vec::new());
            size = 0;
        }
        out.last_mut().expect("one shard at least").push(i);
        size += n;
    }
    out
}

/// The name of shard `i` of `n`: `model.safetensors` alone, else `model-00001-of-00002.safetensors`.
pub(crate) fn shard_name(i: usize, n: usize) -> String {
    if n == 1 {
        "model.safetensors".to_string()
    } else {
        format!("model-{:05}-of-{n:05}.safetensors", i + 1)
    }
}

/// Calls `f(row, row_bytes)` for every row of `out`, split into contiguous blocks over up to
/// `threads` scoped threads. The result does not depend on `threads`.
pub(crate) fn par_rows(out: &mut [u8], row_bytes: usize, threads: usize, f: impl Fn(usize, &mut [u8]) + Sync) {
    if row_bytes == 0 || out.is_empty() {
        return;
    }
    let rows = out.len() / row_bytes;
    let threads = if out.len() < PARALLEL_MIN_BYTES { 1 } else { threads.clamp(1, rows) };
    let rows_per = rows.div_ceil(threads);
    if threads == 1 {
        for (r, buf) in out.chunks_exact_mut(row_bytes).enumerate() {
            f(r, buf);
        }
        return;
    }
    std::thread::scope(|s| {
        for (b, block) in out.chunks_mut(rows_per * row_bytes).enumerate() {
            let f = &f;
            s.spawn(move || {
                for (r, buf) in block.chunks_exact_mut(row_bytes).enumerate() {
                    f(b * rows_per + r, buf);
                }
            });
        }
    });
}

/// Writes `value` pretty-printed with `indent`, as serde_json formats numbers and strings.
pub(crate) fn write_json(path: &Path, value: &Value, indent: &[u8], trailing_newline: bool) -> Result<(), WriteError> {
    let mut buf = json_bytes(value, serde_json::ser::PrettyFormatter::with_indent(indent));
    if trailing_newline {
        buf.push(b'\n');
    }
    fs::write(path, buf).map_err(io_err(path))
}

/// Writes `value` byte for byte as Python's `json.dump(value, f, indent=4)` does (what mlx-lm
/// writes its `config.json` and index with): `ensure_ascii` escapes, floats as `repr` prints them
/// (`1e-06`, `0.0`), no trailing newline.
pub(crate) fn write_json_like_python(path: &Path, value: &Value) -> Result<(), WriteError> {
    let buf = json_bytes(value, PythonFormatter(serde_json::ser::PrettyFormatter::with_indent(b"    ")));
    fs::write(path, buf).map_err(io_err(path))
}

fn json_bytes(value: &Value, formatter: impl serde_json::ser::Formatter) -> Vec<u8> {
    use serde::Serialize;
    let mut buf = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut buf, formatter);
    value.serialize(&mut ser).expect("serialising a serde_json::Value into memory cannot fail");
    buf
}

/// Python's `repr` of a finite float: the shortest digits that round-trip (which Rust's `{:e}`
/// also prints), in positional form when the decimal exponent is in [-4, 16), else as
/// `d.ddde±XX` with at least two exponent digits.
fn python_float(x: f64) -> String {
    let s = format!("{x:e}");
    let (mantissa, exp) = s.split_once('e').expect("`{:e}` always prints an exponent");
    let exp: i32 = exp.parse().expect("`{:e}` prints an integer exponent");
    let sign = if mantissa.starts_with('-') { "-" } else { "" };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if !(-4..16).contains(&exp) {
        let m = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        format!("{sign}{m}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.unsigned_abs())
    } else if exp >= 0 {
        let point = exp as usize + 1;
        if digits.len() <= point {
            format!("{sign}{digits}{}.0", "0".repeat(point - digits.len()))
        } else {
            format!("{sign}{}.{}", &digits[..point], &digits[point..])
        }
    } else {
        format!("{sign}0.{}{digits}", "0".repeat((-exp - 1) as usize))
    }
}

/// serde_json's pretty printer with Python's float and non-ASCII spelling.
struct PythonFormatter<'a>(serde_json::ser::PrettyFormatter<'a>);

impl serde_json::ser::Formatter for PythonFormatter<'_> {
    fn write_f64<W: ?Sized + std::io::Write>(&mut self, w: &mut W, value: f64) -> std::io::Result<()> {
        w.write_all(python_float(value).as_bytes())
    }
    fn write_f32<W: ?Sized + std::io::Write>(&mut self, w: &mut W, value: f32) -> std::io::Result<()> {
        self.write_f64(w, f64::from(value))
    }
    fn write_string_fragment<W: ?Sized + std::io::Write>(&mut self, w: &mut W, fragment: &str) -> std::io::Result<()> {
        // serde_json already escapes quotes, backslashes and controls as Python does; `ensure_ascii`
        // also escapes DEL and everything past ASCII, as UTF-16 code units.
        for c in fragment.chars() {
            if (' '..='~').contains(&c) {
                w.write_all(&[c as u8])?;
            } else {
                for unit in c.encode_utf16(&mut [0; 2]) {
                    write!(w, "\\u{unit:04x}")?;
                }
            }
        }
        Ok(())
    }
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_array(w)
    }
    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_array(w)
    }
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        self.0.begin_array_value(w, first)
    }
    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_array_value(w)
    }
    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_object(w)
    }
    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object(w)
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        self.0.begin_object_key(w, first)
    }
    fn end_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object_key(w)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_object_value(w)
    }
    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object_value(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::TempDir;
    use serde_json::json;

    #[test]
    fn floats_are_spelled_as_python_repr_spells_them() {
        // Each pair is (value, Python 3's repr of it).
        let cases = [
            (1e-6, "1e-06"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (0.02, "0.02"),
            (0.25, "0.25"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e300, "1.5e+300"),
            (123.456, "123.456"),
            (-2.5e-7, "-2.5e-07"),
            (10000000.0, "10000000.0"),
        ];
        for (x, want) in cases {
            assert_eq!(python_float(x), want, "{x}");
        }
    }

    #[test]
    fn json_is_written_as_python_writes_it() {
        let tmp = TempDir::new("writer-json");
        let p = tmp.path().join("c.json");
        let v = json!({"eps": 1e-6, "n": 10000000, "list": [1, 2], "empty": [], "obj": {}, "s": "é\u{7f}😀\"\n"});
        write_json_like_python(&p, &v).unwrap();
        // What `json.dump(v, f, indent=4)` writes for the same dict.
        let want = "{\n    \"eps\": 1e-06,\n    \"n\": 10000000,\n    \"list\": [\n        1,\n        2\n    ],\n    \"empty\": [],\n    \"obj\": {},\n    \"s\": \"\\u00e9\\u007f\\ud83d\\ude00\\\"\\n\"\n}";
        assert_eq!(fs::read_to_string(&p).unwrap(), want);
    }

    #[test]
    fn staging_is_removed_unless_committed_and_refuses_a_taken_target() {
        let tmp = TempDir::new("writer-staging");
        let out = tmp.path().join("out");
        {
            let s = Staging::new(&out, "t").unwrap();
            fs::write(s.path().join("f"), b"x").unwrap();
        }
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 0, "a dropped staging directory is removed");
        let s = Staging::new(&out, "t").unwrap();
        fs::write(s.path().join("f"), b"x").unwrap();
        s.commit().unwrap();
        assert_eq!(fs::read(out.join("f")).unwrap(), b"x");
        assert!(matches!(Staging::new(&out, "t"), Err(WriteError::OutDirNotEmpty(p)) if p == out));
        assert!(matches!(check_out_dir(&out.join("f")), Err(WriteError::OutPathNotDir(_))));
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 1, "only `out` is left");
    }

    #[test]
    fn shards_follow_the_size_limit() {
        assert_eq!(shards(&[4, 4, 3, 9, 1], 8), vec![vec![0, 1], vec![2], vec![3], vec![4]]);
        assert_eq!(shards(&[4, 4, 3, 9, 1], 100), vec![vec![0, 1, 2, 3, 4]]);
        assert_eq!(shard_name(0, 1), "model.safetensors");
        assert_eq!(shard_name(1, 3), "model-00002-of-00003.safetensors");
    }
}
