//! Writing a file atomically: readers of the target see its old contents or the complete new
//! ones, never a partial write, and a failed write leaves nothing behind.
//!
//! The data goes to a uniquely named temporary file created beside the target (same directory,
//! so the final rename stays on one file system), which is synced and then renamed over the
//! target. The temporary file is removed on every error path, including a panic in the writer
//! (it lives in a [`tempfile::NamedTempFile`], removed on drop). Its name is unique
//! (`.NAME.XXXXXX.tmp`, created with `O_EXCL`), so it never replaces a file of the user's, such
//! as a `NAME.tmp` sitting beside the target.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

/// Why [`write_atomic`] failed. Every variant names the target path; nothing was written to it
/// and no temporary file was left behind.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The target is an existing directory (a file cannot replace it).
    #[error("{}: is a directory", path.display())]
    IsDirectory { path: PathBuf },
    /// The temporary file could not be created in the target's directory (missing directory,
    /// no permission, ...).
    #[error("{}: cannot create a temporary file in {}: {source}", path.display(), dir.display())]
    Create {
        path: PathBuf,
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Writing or syncing the data failed (including errors the caller's writer returned).
    #[error("{}: {source}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Renaming the complete temporary file over the target failed.
    #[error("{}: cannot move the written file into place: {source}", path.display())]
    Rename {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Writes `path` atomically: `write` fills a fresh temporary file beside `path` (given as an
/// open [`File`], positioned at its start), which is then synced to disk and renamed over
/// `path`, replacing any file there.
///
/// The new file gets the permissions `File::create` would give it (`0o666` less the umask on
/// Unix), not the owner-only mode of a temporary file.
///
/// # Errors
/// [`WriteError::IsDirectory`] when `path` is an existing directory (checked before `write`
/// runs); [`WriteError::Create`], [`WriteError::Write`] (also for an error `write` returns) and
/// [`WriteError::Rename`] otherwise. On every error the temporary file is removed and `path` is
/// untouched.
pub fn write_atomic(path: &Path, write: impl FnOnce(&mut File) -> io::Result<()>) -> Result<(), WriteError> {
    if path.is_dir() {
        return Err(WriteError::IsDirectory { path: path.to_path_buf() });
    }
    // `Path::parent` of a bare file name is "": the current directory.
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut prefix = std::ffi::OsString::from(".");
    prefix.push(path.file_name().unwrap_or_default());
    prefix.push(".");
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(".tmp");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    let mut tmp = builder.tempfile_in(dir).map_err(|source| WriteError::Create { path: path.to_path_buf(), dir: dir.to_path_buf(), source })?;
    let written = write(tmp.as_file_mut()).and_then(|()| tmp.as_file().sync_all());
    if let Err(source) = written {
        // Dropping `tmp` removes the temporary file.
        return Err(WriteError::Write { path: path.to_path_buf(), source });
    }
    // On failure the returned PersistError owns the temporary file and removes it when dropped.
    tmp.persist(path).map_err(|e| WriteError::Rename { path: path.to_path_buf(), source: e.error })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::TempDir;
    use std::io::Write;

    /// Names of the entries of `dir`, sorted.
    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        names
    }

    #[test]
    fn writes_and_replaces_the_target() {
        let tmp = TempDir::new("fsutil-write");
        let path = tmp.path().join("out.bin");
        write_atomic(&path, |f| f.write_all(b"first")).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"first");
        write_atomic(&path, |f| f.write_all(b"second, longer")).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second, longer");
        assert_eq!(entries(tmp.path()), ["out.bin"]);
        #[cfg(unix)]
        {
            // Not the 0o600 of a temporary file: what File::create gives under the same umask.
            use std::os::unix::fs::PermissionsExt;
            let reference = tmp.path().join("reference");
            File::create(&reference).unwrap();
            let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode(&path), mode(&reference));
        }
    }

    #[test]
    fn a_directory_target_is_an_error_naming_it_and_leaves_nothing_behind() {
        let tmp = TempDir::new("fsutil-dir");
        let target = tmp.path().join("logs");
        std::fs::create_dir(&target).unwrap();
        let mut called = false;
        let err = write_atomic(&target, |f| {
            called = true;
            f.write_all(b"x")
        })
        .unwrap_err();
        assert!(matches!(err, WriteError::IsDirectory { .. }), "{err}");
        assert_eq!(err.to_string(), format!("{}: is a directory", target.display()));
        assert!(!called, "nothing is written for a target that cannot be replaced");
        assert_eq!(entries(tmp.path()), ["logs"]);
        assert!(entries(&target).is_empty());
    }

    #[test]
    fn a_users_tmp_file_beside_the_target_is_untouched() {
        let tmp = TempDir::new("fsutil-user-tmp");
        let path = tmp.path().join("x.safetensors");
        let theirs = tmp.path().join("x.safetensors.tmp");
        std::fs::write(&theirs, b"the user's own file").unwrap();
        write_atomic(&path, |f| f.write_all(b"ours")).unwrap();
        assert_eq!(std::fs::read(&theirs).unwrap(), b"the user's own file");
        assert_eq!(std::fs::read(&path).unwrap(), b"ours");
        assert_eq!(entries(tmp.path()), ["x.safetensors", "x.safetensors.tmp"]);
    }

    #[test]
    fn a_failing_writer_leaves_the_old_target_and_no_temporary_file() {
        let tmp = TempDir::new("fsutil-fail");
        let path = tmp.path().join("s.bin");
        std::fs::write(&path, b"old").unwrap();
        let err = write_atomic(&path, |f| {
            f.write_all(b"partial")?;
            Err(io::Error::other("disk on fire"))
        })
        .unwrap_err();
        assert!(matches!(err, WriteError::Write { .. }), "{err}");
        assert_eq!(err.to_string(), format!("{}: disk on fire", path.display()));
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        assert_eq!(entries(tmp.path()), ["s.bin"]);

        // A panicking writer too (the temporary file is removed as the stack unwinds).
        let caught = std::panic::catch_unwind(|| {
            let _ = write_atomic(&path, |f| {
                f.write_all(b"partial").unwrap();
                panic!("writer panicked")
            });
        });
        assert!(caught.is_err());
        assert_eq!(entries(tmp.path()), ["s.bin"]);
    }

    #[test]
    fn a_missing_directory_is_an_error_naming_the_target() {
        let tmp = TempDir::new("fsutil-nodir");
        let path = tmp.path().join("missing").join("out.bin");
        let err = write_atomic(&path, |f| f.write_all(b"x")).unwrap_err();
        assert!(matches!(err, WriteError::Create { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.starts_with(&format!("{}: cannot create a temporary file in {}", path.display(), path.parent().unwrap().display())), "{msg}");
    }
}
