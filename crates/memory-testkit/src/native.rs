//! Building C and C++ at test time with the `cc` crate: shared libraries (plugins) and
//! executables (programs against the C API). `cc` finds the system compiler (`CC` /
//! `CXX` are honoured) and its flags for this target; outputs are cached by a hash of
//! their inputs, and written under a private name then renamed, so concurrent test
//! processes never see a half-written file.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The language of a build.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Language {
    /// C, with the given `-std=` (for example `"c11"`).
    C(&'static str),
    /// C++, with the given `-std=` (for example `"c++17"`).
    Cpp(&'static str),
}

/// One build: sources, include directories, extra arguments (libraries, defines).
#[derive(Clone, Debug)]
pub struct NativeBuild {
    language: Language,
    sources: Vec<PathBuf>,
    includes: Vec<PathBuf>,
    args: Vec<String>,
}

impl NativeBuild {
    /// A build in `language`.
    pub fn new(language: Language) -> NativeBuild {
        NativeBuild { language, sources: Vec::new(), includes: Vec::new(), args: Vec::new() }
    }

    /// Adds a source file.
    #[must_use]
    pub fn source(mut self, path: impl Into<PathBuf>) -> NativeBuild {
        self.sources.push(path.into());
        self
    }

    /// Adds an include directory.
    #[must_use]
    pub fn include(mut self, path: impl Into<PathBuf>) -> NativeBuild {
        self.includes.push(path.into());
        self
    }

    /// Adds an argument (placed after the sources: libraries, `-D` defines, ...).
    #[must_use]
    pub fn arg(mut self, arg: impl Into<String>) -> NativeBuild {
        self.args.push(arg.into());
        self
    }

    fn command(&self) -> Command {
        let target = env!("MEMORY_TESTKIT_TARGET");
        let mut build = cc::Build::new();
        build
            .target(target)
            .host(target)
            .opt_level(1)
            .debug(true)
            .cargo_metadata(false)
            .cargo_warnings(false)
            .warnings(true)
            .extra_warnings(true)
            .cpp(matches!(self.language, Language::Cpp(_)));
        let tool = build.try_get_compiler().unwrap_or_else(|e| panic!("the cc crate found no compiler: {e}"));
        let mut command = tool.to_command();
        match self.language {
            Language::C(std) => command.arg(format!("-std={std}")),
            Language::Cpp(std) => command.arg(format!("-std={std}")),
        };
        command.args(["-Werror", "-pedantic"]);
        for include in &self.includes {
            command.arg("-I").arg(include);
        }
        command
    }

    fn fingerprint(&self, kind: &str) -> u64 {
        let mut hasher = DefaultHasher::new();
        kind.hash(&mut hasher);
        self.language.hash(&mut hasher);
        for path in self.sources.iter() {
            std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display())).hash(&mut hasher);
        }
        for include in &self.includes {
            if let Ok(entries) = std::fs::read_dir(include) {
                let mut files: Vec<_> = entries.filter_map(Result::ok).map(|e| e.path()).collect();
                files.sort();
                for file in files {
                    std::fs::read(&file).unwrap_or_default().hash(&mut hasher);
                }
            }
        }
        self.args.hash(&mut hasher);
        // An argument naming a file (a library to link) counts by size and time.
        for arg in &self.args {
            if let Ok(meta) = std::fs::metadata(arg) {
                meta.len().hash(&mut hasher);
                meta.modified().ok().hash(&mut hasher);
            }
        }
        hasher.finish()
    }

    fn run(&self, kind: &str, flags: &[&str], out_dir: &Path, name: &str) -> PathBuf {
        let dir = out_dir.join(format!("{name}-{:016x}", self.fingerprint(kind)));
        let output = dir.join(name);
        if output.exists() {
            return output;
        }
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        static BUILDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let build = BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let partial = dir.join(format!("{name}.partial-{}-{build}", std::process::id()));
        let mut command = self.command();
        command.args(flags).arg("-o").arg(&partial).args(&self.sources).args(&self.args);
        let shown = std::iter::once(command.get_program())
            .chain(command.get_args())
            .map(|part| part.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ");
        let result = command.output().unwrap_or_else(|e| panic!("running the compiler ({shown}): {e}"));
        assert!(
            result.status.success(),
            "building {name} failed ({shown}):\n{}{}",
            String::from_utf8_lossy(&result.stdout),
            String::from_utf8_lossy(&result.stderr)
        );
        if let Err(error) = std::fs::rename(&partial, &output) {
            // Another build of the same inputs may have finished first; its output is ours.
            assert!(output.exists(), "renaming {}: {error}", partial.display());
        }
        output
    }

    /// Builds a shared library `name` (for example `libplugin.so`) under `out_dir`.
    ///
    /// # Panics
    /// When the compiler is missing or the build fails (with the compiler's output).
    pub fn shared_library(&self, out_dir: &Path, name: &str) -> PathBuf {
        self.run("shared", &["-shared", "-fPIC"], out_dir, name)
    }

    /// Builds an executable `name` under `out_dir`.
    ///
    /// # Panics
    /// When the compiler is missing or the build fails (with the compiler's output).
    pub fn executable(&self, out_dir: &Path, name: &str) -> PathBuf {
        self.run("executable", &[], out_dir, name)
    }

    /// Compiles the sources without linking (a header check).
    ///
    /// # Panics
    /// When the compiler is missing or the compilation fails (with its output).
    pub fn check(&self, out_dir: &Path, name: &str) -> PathBuf {
        self.run("object", &["-c"], out_dir, name)
    }
}
