//! [`OrtEnvironment`]: ONNX Runtime's process-wide environment, and the one place
//! sessions are committed with a governed allocator ([`GovernedSession`]).
//!
//! # Registration
//! ONNX Runtime hands an environment's registered allocator to every session created
//! with `session.use_env_allocators = 1`, and the session keeps it. One allocator per
//! memory info can be registered at a time. So a commit registers the tenant's
//! allocator (`RegisterAllocator`), creates the session, and unregisters it
//! (`UnregisterAllocator`), all under one process-wide lock (session creation is the
//! cold path). Each session keeps the allocator it was created with; two tenants'
//! sessions in one process each use their own. The environment never holds the
//! pointer outside that window, so nothing outlives its owner there.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use ort::AsPointer;
use ort::session::builder::SessionBuilder;
use ort::session::{RunOptions, Session, SessionInputs, SessionOutputs};

use crate::allocator::GovernedOrtAllocator;
use crate::blocks::Watch;
use crate::error::OrtAdapterError;
use crate::ffi::{self, Core};

/// Serialises register-create-unregister windows: the environment is per process, and
/// one allocator per memory info can be registered at a time.
static REGISTRATION: Mutex<()> = Mutex::new(());

/// ONNX Runtime's environment (one per process), through which governed sessions are
/// committed.
#[derive(Clone, Debug)]
pub struct OrtEnvironment {
    environment: ort::environment::Environment,
}

impl OrtEnvironment {
    /// Loads the ONNX Runtime library at `library` and builds the process's environment.
    ///
    /// # Errors
    /// [`OrtAdapterError::Load`] when the library cannot be loaded or an environment was
    /// already built in this process (use [`OrtEnvironment::from_environment`] with it).
    pub fn load(library: impl AsRef<Path>) -> Result<OrtEnvironment, OrtAdapterError> {
        let library = library.as_ref();
        let load_error = |message: String| OrtAdapterError::Load { path: library.display().to_string(), message };
        if !library.is_file() {
            return Err(load_error("no such file".to_owned()));
        }
        let builder = ort::init_from(library).map_err(|err| load_error(err.to_string()))?;
        let environment = builder.with_name("memory-ort").build().map_err(|err| load_error(err.to_string()))?;
        tracing::info!(library = %library.display(), version = ort::info(), "onnx runtime environment built");
        Ok(OrtEnvironment { environment })
    }

    /// Wraps an environment the runtime already built.
    pub fn from_environment(environment: ort::environment::Environment) -> OrtEnvironment {
        OrtEnvironment { environment }
    }

    /// The `ort` environment.
    pub fn environment(&self) -> &ort::environment::Environment {
        &self.environment
    }

    /// A session builder on this environment, to configure before committing.
    ///
    /// # Errors
    /// [`OrtAdapterError::Runtime`] when ONNX Runtime cannot create session options.
    pub fn session_builder(&self) -> Result<SessionBuilder, OrtAdapterError> {
        Session::builder(&self.environment).map_err(|err| runtime("create session options", &err))
    }

    /// A session without the adapter, on ONNX Runtime's own CPU allocator (with or
    /// without its arena, with or without weight prepacking): the baseline the tests,
    /// the demo and the bench compare governed sessions with.
    ///
    /// # Errors
    /// [`OrtAdapterError::Runtime`] when ONNX Runtime cannot create the session.
    pub fn plain_session(&self, model: &Path, arena: bool, prepacking: bool) -> Result<Session, OrtAdapterError> {
        let cpu = ort::ep::CPU::default().with_arena_allocator(arena).build();
        self.session_builder()?
            .with_no_environment_execution_providers()
            .and_then(|builder| builder.with_execution_providers([cpu]))
            .and_then(|builder| builder.with_prepacking(prepacking))
            .map_err(|err| runtime("configure a plain session", &err))?
            .commit_from_file(model)
            .map_err(|err| runtime("create the session", &err))
    }

    /// Commits a session from a model file whose CPU (or CUDA) memory all comes from
    /// `allocator`. Weight prepacking follows [`OrtAllocatorConfig::prepacking`](crate::OrtAllocatorConfig::prepacking)
    /// (off by default, so every weight byte is booked). The builder's logger is replaced by one that forwards ONNX Runtime's
    /// session log to `tracing` (target `memory_ort::onnxruntime`); it also keeps the
    /// allocator alive for as long as ONNX Runtime keeps the session.
    ///
    /// # Errors
    /// [`OrtAdapterError::Refused`] when session creation failed because the governor
    /// refused memory (its reason included), [`OrtAdapterError::Runtime`] for other
    /// ONNX Runtime errors, [`OrtAdapterError::Registration`] when the allocator could
    /// not be registered.
    pub fn commit_from_file(
        &self,
        allocator: &GovernedOrtAllocator,
        builder: SessionBuilder,
        model: impl AsRef<Path>,
    ) -> Result<GovernedSession, OrtAdapterError> {
        let model = model.as_ref();
        self.commit(allocator, builder, |builder| builder.commit_from_file(model))
    }

    /// As [`OrtEnvironment::commit_from_file`], from model bytes.
    ///
    /// # Errors
    /// As [`OrtEnvironment::commit_from_file`].
    pub fn commit_from_memory(
        &self,
        allocator: &GovernedOrtAllocator,
        builder: SessionBuilder,
        model: &[u8],
    ) -> Result<GovernedSession, OrtAdapterError> {
        self.commit(allocator, builder, |builder| builder.commit_from_memory(model))
    }

    fn commit(
        &self,
        allocator: &GovernedOrtAllocator,
        builder: SessionBuilder,
        create: impl FnOnce(&mut SessionBuilder) -> ort::Result<Session>,
    ) -> Result<GovernedSession, OrtAdapterError> {
        let keep_alive = Arc::clone(&allocator.core);
        let builder = builder
            .with_env_allocators()
            .map_err(|err| runtime("opt the session into environment allocators", &err))?
            .with_prepacking(allocator.config().prepacks())
            .map_err(|err| runtime("set weight prepacking", &err))?;
        let mut builder = builder
            .with_logger(Arc::new(move |level, category, id, location, message| {
                // The closure owns a count of the allocator core: ONNX Runtime keeps the
                // session's logger until the session is released, so the allocator
                // outlives every call the session can make.
                let _owner = &keep_alive;
                forward_log(level, category, id, location, message);
            }))
            .map_err(|err| runtime("set the session logger", &err))?;
        let watch = Watch::new(None);
        let created = {
            let _window = REGISTRATION.lock().unwrap_or_else(PoisonError::into_inner);
            self.register(&allocator.core)?;
            let _committing = allocator.core.blocks.enter_commit(Arc::clone(&watch));
            let created = create(&mut builder);
            self.unregister(&allocator.core);
            created
        };
        drop(builder);
        match created {
            Ok(session) => {
                let run_options =
                    Arc::new(RunOptions::new().map_err(|err| runtime("create the session's run options", &err))?);
                tracing::info!(binding = %allocator.binding().identity(), "governed ort session committed");
                Ok(GovernedSession { session, run_options, allocator: allocator.clone() })
            }
            Err(err) => Err(explain(&watch, "create the session", &err.to_string())),
        }
    }

    fn register(&self, core: &Arc<Core>) -> Result<(), OrtAdapterError> {
        let env = self.environment.ptr().cast_mut();
        #[allow(unsafe_code)]
        // SAFETY: `env` is this live environment; the caller holds `core` for the whole
        // window and `unregister` runs before it closes (keeping the core alive if that
        // fails).
        let registered = unsafe { ffi::register(env, core) };
        registered.map_err(|message| OrtAdapterError::Registration { action: "register", message })?;
        tracing::debug!("governed ort allocator registered with the environment");
        Ok(())
    }

    fn unregister(&self, core: &Arc<Core>) {
        let env = self.environment.ptr().cast_mut();
        #[allow(unsafe_code)]
        // SAFETY: `env` is this live environment.
        let unregistered = unsafe { ffi::unregister(env, core) };
        match unregistered {
            Ok(()) => tracing::debug!("governed ort allocator unregistered from the environment"),
            Err(message) => {
                // The environment may still hand the table out: keep the core alive for as
                // long as the environment can (a bounded leak, never a dangling pointer).
                tracing::error!(%message, "could not unregister the governed ort allocator; it is kept alive");
                std::mem::forget(Arc::clone(core));
            }
        }
    }
}

/// A session whose memory comes from a [`GovernedOrtAllocator`]. Run it through
/// [`GovernedSession::run`]: a refusal during the run stops it at the next kernel
/// boundary and the error carries the governor's reason.
pub struct GovernedSession {
    session: Session,
    run_options: Arc<RunOptions>,
    allocator: GovernedOrtAllocator,
}

impl std::fmt::Debug for GovernedSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GovernedSession").field("session", &self.session).field("allocator", &self.allocator).finish()
    }
}

impl GovernedSession {
    /// Runs the session.
    ///
    /// ONNX Runtime's tensors do not check the pointer an allocator returns, so a
    /// request the governor refuses during a run is served from a small host overdraft
    /// outside the books (counted in [`OrtAllocatorStats`](crate::OrtAllocatorStats))
    /// while the run is stopped at its next kernel boundary; the overdraft is freed as
    /// the failed run unwinds.
    ///
    /// # Errors
    /// [`OrtAdapterError::Refused`] when the run failed because the governor refused
    /// memory (the tenant's quota or the device limit; the reason says which and what
    /// to change) or the device was lost, [`OrtAdapterError::Runtime`] for other errors.
    pub fn run<'s, 'i, 'v: 'i, const N: usize>(
        &'s mut self,
        inputs: impl Into<SessionInputs<'i, 'v, N>>,
    ) -> Result<SessionOutputs<'s>, OrtAdapterError> {
        self.run_options.unterminate().map_err(|err| runtime("reset the run options", &err))?;
        let options = Arc::clone(&self.run_options);
        let watch = Watch::new(Some(Box::new(move || {
            if let Err(err) = options.terminate() {
                tracing::error!(%err, "could not stop the run after a refusal");
            }
        })));
        let result = {
            let _running = self.allocator.core.blocks.enter_run(Arc::clone(&watch));
            self.session.run_with_options(inputs, &self.run_options)
        };
        match result {
            // The run may finish before it reaches a kernel boundary after a refusal: its
            // outputs then hold overdraft memory, so they are discarded.
            Ok(outputs) => match watch.reason() {
                None => Ok(outputs),
                Some(reason) => {
                    drop(outputs);
                    Err(OrtAdapterError::Refused {
                        action: "run",
                        reason,
                        runtime: "the run finished on overdraft memory; its outputs were discarded".to_owned(),
                    })
                }
            },
            Err(err) => Err(explain(&watch, "run", &err.to_string())),
        }
    }

    /// The `ort` session (inputs, outputs, metadata). Runs go through
    /// [`GovernedSession::run`], which can stop a run the governor refuses.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// The allocator the session's memory comes from.
    pub fn allocator(&self) -> &GovernedOrtAllocator {
        &self.allocator
    }
}

fn runtime(action: &'static str, err: &dyn std::fmt::Display) -> OrtAdapterError {
    OrtAdapterError::Runtime { action, message: err.to_string() }
}

/// An ONNX Runtime error, with the governor's reason when a refusal happened during the
/// call (ONNX Runtime only sees a null pointer or a stopped run).
fn explain(watch: &Watch, action: &'static str, runtime: &str) -> OrtAdapterError {
    match watch.reason() {
        Some(reason) => OrtAdapterError::Refused { action, reason, runtime: runtime.to_owned() },
        None => OrtAdapterError::Runtime { action, message: runtime.to_owned() },
    }
}

fn forward_log(level: ort::logging::LogLevel, category: &str, id: &str, location: &str, message: &str) {
    use ort::logging::LogLevel;
    match level {
        LogLevel::Verbose => {
            tracing::trace!(target: "memory_ort::onnxruntime", category, id, location, "{message}")
        }
        LogLevel::Info => tracing::debug!(target: "memory_ort::onnxruntime", category, id, location, "{message}"),
        LogLevel::Warning => tracing::warn!(target: "memory_ort::onnxruntime", category, id, location, "{message}"),
        LogLevel::Error | LogLevel::Fatal => {
            tracing::error!(target: "memory_ort::onnxruntime", category, id, location, "{message}")
        }
    }
}
