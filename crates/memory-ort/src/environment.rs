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

use std::mem::ManuallyDrop;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use ort::AsPointer;
use parking_lot::{ReentrantMutex, ReentrantMutexGuard};

use ort::session::builder::SessionBuilder;
use ort::session::{
    IoBinding, NoSelectedOutputs, RunOptions, SelectedOutputMarker, Session, SessionInputs, SessionOutputs,
};

use crate::allocator::GovernedOrtAllocator;
use crate::blocks::OrtAllocatorStats;
use crate::caller::{Phase, StopFlag};
use crate::error::OrtAdapterError;
use crate::ffi::{self, Core};

/// Serials of committed sessions (for logs and hold names; not an identity).
static NEXT_SESSION: AtomicU64 = AtomicU64::new(1);

/// Serialises register-create-unregister windows: the environment is per process, and
/// one allocator per memory info can be registered at a time. A governed session is
/// released under it too, so ONNX Runtime freeing one session's memory does not show in
/// the heap measure of another's commit.
///
/// Reentrant: a commit's allocation may call the governor's reclaim holders on the
/// committing thread, and a holder may drop an idle session, which takes this lock
/// again. That release runs inside the allocation's `heap::own_work`, so what it frees
/// is kept out of the commit's measure as the adapter's own work.
static REGISTRATION: ReentrantMutex<()> = ReentrantMutex::new(());

/// Sessions whose release could not wait for a stalled commit (see [`release`]): the
/// next thread to hold the commit lock releases them, under it, before letting it go.
static DEFERRED: Mutex<Vec<Session>> = Mutex::new(Vec::new());

/// The allocations of the commit in progress that have not returned (on any thread),
/// and since when one has been in progress without a break.
static COMMIT_ALLOCATING: Mutex<(usize, Option<Instant>)> = Mutex::new((0, None));

/// How long a release waits for the commit lock between looks at the commit.
const RELEASE_POLL: Duration = Duration::from_millis(5);

/// How long a commit's allocation must have been in progress for a release to stop
/// waiting for the commit: far longer than an allocation takes, unless the governor is
/// calling a reclaim holder that waits (for a lock the releasing thread may hold).
const COMMIT_STALLED: Duration = Duration::from_millis(200);

fn locked<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs an allocation of a commit (the governor may call reclaim holders inside it),
/// so a release on another thread can tell a commit stalled in one (see [`release`]).
pub(crate) fn commit_allocation<R>(allocate: impl FnOnce() -> R) -> R {
    /// Leaves also if `allocate` unwinds.
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            let mut allocating = locked(&COMMIT_ALLOCATING);
            allocating.0 = allocating.0.saturating_sub(1);
            if allocating.0 == 0 {
                allocating.1 = None;
            }
        }
    }
    {
        let mut allocating = locked(&COMMIT_ALLOCATING);
        if allocating.0 == 0 {
            allocating.1 = Some(Instant::now());
        }
        allocating.0 += 1;
    }
    let _leave = Leave;
    allocate()
}

/// Whether the commit in progress has been inside an allocation for
/// [`COMMIT_STALLED`] or longer.
fn commit_stalled() -> bool {
    locked(&COMMIT_ALLOCATING).1.is_some_and(|since| since.elapsed() >= COMMIT_STALLED)
}

/// The commit lock held; letting it go releases the sessions deferred meanwhile.
struct CommitLock(Option<ReentrantMutexGuard<'static, ()>>);

impl CommitLock {
    fn take() -> CommitLock {
        CommitLock(Some(REGISTRATION.lock()))
    }
}

impl Drop for CommitLock {
    fn drop(&mut self) {
        drop(self.0.take());
        release_deferred();
    }
}

/// Releases the deferred sessions when the commit lock is free (its holder, letting it
/// go, does the same: a session deferred while it was held is released by someone).
fn release_deferred() {
    while !locked(&DEFERRED).is_empty() {
        let Some(_window) = REGISTRATION.try_lock() else { return };
        let sessions = std::mem::take(&mut *locked(&DEFERRED));
        tracing::debug!(sessions = sessions.len(), "sessions deferred past a stalled commit released");
        drop(sessions);
    }
}

/// Releases a governed session (ONNX Runtime frees its own memory for it then, unless
/// an output still holds it) under the commit lock, so the frees do not show in another
/// commit's heap measure. It waits for a commit in progress, except one stalled inside
/// an allocation (the governor calling a reclaim holder that waits, perhaps for a lock
/// the calling thread holds: waiting for it would stop both threads for good); the
/// session is then released as soon as that commit lets the lock go.
fn release(session: Session) {
    loop {
        if let Some(window) = REGISTRATION.try_lock_for(RELEASE_POLL) {
            let _window = CommitLock(Some(window));
            drop(session);
            return;
        }
        if commit_stalled() {
            tracing::warn!(
                "a session dropped while a commit is stalled in a reclaim holder: released once that commit is done"
            );
            locked(&DEFERRED).push(session);
            release_deferred();
            return;
        }
    }
}

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
        OrtEnvironment::load_with(library, Ok)
    }

    /// As [`OrtEnvironment::load`], with the environment configured by `configure`
    /// first, once the library is loaded (so `configure` may call ONNX Runtime): for
    /// example a global thread pool shared by every session
    /// (`builder.with_global_thread_pool(options)`; sessions then use it instead of
    /// threads of their own).
    ///
    /// # Errors
    /// As [`OrtEnvironment::load`], also when `configure` fails.
    pub fn load_with(
        library: impl AsRef<Path>,
        configure: impl FnOnce(ort::environment::EnvironmentBuilder) -> ort::Result<ort::environment::EnvironmentBuilder>,
    ) -> Result<OrtEnvironment, OrtAdapterError> {
        let library = library.as_ref();
        let load_error = |message: String| OrtAdapterError::Load { path: library.display().to_string(), message };
        if !library.is_file() {
            return Err(load_error("no such file".to_owned()));
        }
        let builder = ort::init_from(library).map_err(|err| load_error(err.to_string()))?;
        let environment = configure(builder.with_name("memory-ort"))
            .and_then(ort::environment::EnvironmentBuilder::build)
            .map_err(|err| load_error(err.to_string()))?;
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
    /// `allocator`, and books what ONNX Runtime keeps of its own for it (measured across
    /// the commit; see the crate docs and
    /// [`OrtAllocatorConfig::charge_runtime_memory`](crate::OrtAllocatorConfig::charge_runtime_memory)).
    /// Weight prepacking follows [`OrtAllocatorConfig::prepacking`](crate::OrtAllocatorConfig::prepacking)
    /// (on by default, as in a stock session). The builder's logger is replaced by one
    /// that forwards ONNX Runtime's session log to `tracing` (target
    /// `memory_ort::onnxruntime`); it also keeps the allocator alive for as long as ONNX
    /// Runtime keeps the session.
    ///
    /// # Errors
    /// [`OrtAdapterError::Refused`] when session creation failed because the governor
    /// refused memory, a block or ONNX Runtime's own memory for the session (its reason
    /// included; the session is released), [`OrtAdapterError::Runtime`] for other
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
        // The session's own table: every call through it is this session's, on whatever
        // thread ONNX Runtime makes it. It holds the provider context open while the
        // session or a block it handed out can still call.
        let serial = NEXT_SESSION.fetch_add(1, Ordering::Relaxed);
        let hold = allocator.binding().hold_callers(format!("onnx runtime session {serial}"));
        let core = Core::for_session(&allocator.core, hold);
        let keep_alive = Arc::clone(&core);
        let builder = builder
            .with_env_allocators()
            .map_err(|err| runtime("opt the session into environment allocators", &err))?
            .with_prepacking(allocator.config().prepacks())
            .map_err(|err| runtime("set weight prepacking", &err))?;
        let mut builder = builder
            .with_logger(Arc::new(move |level, category, id, location, message| {
                // The closure owns a count of the session's core: ONNX Runtime keeps the
                // session's logger until the session is released, so the table outlives
                // every call the session can make.
                // What a subscriber keeps of the event is the adapter's, not ONNX Runtime's.
                let _owner = &keep_alive;
                crate::heap::own_work(|| forward_log(level, category, id, location, message));
            }))
            .map_err(|err| runtime("set the session logger", &err))?;
        let (created, refusal) = {
            let _window = CommitLock::take();
            self.register(&core)?;
            // Unregisters and ends the commit phase also if `create` unwinds: the
            // environment must never keep the table of a core that is gone.
            let window = CommitWindow { environment: self, core: &core };
            core.caller.begin(Phase::Committing, None);
            let measure = crate::heap::Measure::start();
            let created = create(&mut builder);
            let runtime_held = measure.grown().map(runtime_memory);
            let refusal = core.caller.end();
            drop(window);
            (created.map(|session| (session, runtime_held)), refusal)
        };
        drop(builder);
        match created {
            // A request of the commit was refused and served past the refusal (ONNX
            // Runtime does not check every pointer it is given while it commits): the
            // session goes, and the commit fails with the governor's reason.
            Ok((session, _)) if refusal.is_some() => {
                release_unwrapped(session);
                Err(explain(
                    refusal,
                    "create the session",
                    "a request was refused while onnx runtime created the session; it was served from the \
                     overdraft (or the scratch sink) until the session was complete, then released",
                ))
            }
            Ok((session, runtime_held)) => {
                if allocator.config().charges_runtime_memory()
                    && let Err(refused) = self.book_runtime_memory(allocator, &core, serial, runtime_held)
                {
                    // ONNX Runtime frees what it kept; the table goes with the last block.
                    release_unwrapped(session);
                    return Err(refused);
                }
                let run_options = match RunOptions::new() {
                    Ok(options) => options,
                    Err(err) => {
                        release_unwrapped(session);
                        return Err(runtime("create the session's run options", &err));
                    }
                };
                // What ONNX Runtime loaded the model with is free now: it leaves the process
                // rather than stay resident under the runs' peak.
                core.blocks.return_heap_pages(&core.caller.counters);
                tracing::info!(binding = %allocator.binding().identity(), serial, "governed ort session committed");
                Ok(GovernedSession {
                    session: ManuallyDrop::new(session),
                    run_options,
                    allocator: allocator.clone(),
                    core,
                    serial,
                    shapes: SeenShapes::default(),
                })
            }
            Err(err) => Err(explain(refusal, "create the session", &err.to_string())),
        }
    }

    /// Books what ONNX Runtime kept of its own for the session (`None`: not measurable
    /// here) to the reserve role, for as long as `core` lives.
    fn book_runtime_memory(
        &self,
        allocator: &GovernedOrtAllocator,
        core: &Core,
        serial: u64,
        runtime_held: Option<u64>,
    ) -> Result<(), OrtAdapterError> {
        let Some(bytes) = runtime_held else {
            tracing::warn!(serial, "onnx runtime's own memory for the session cannot be measured here; none is booked");
            return Ok(());
        };
        match allocator.core.blocks.book_runtime(&core.caller, bytes) {
            Ok(Some(lease)) => {
                tracing::debug!(serial, bytes, "onnx runtime's own memory for the session measured and booked");
                core.keep_runtime_lease(lease);
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(reason) => Err(OrtAdapterError::Refused {
                action: "create the session",
                reason,
                runtime: format!(
                    "the session was created, but the {bytes} bytes ONNX Runtime holds of its own for it (measured at \
                     commit) could not be booked; it was released"
                ),
            }),
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

/// What ONNX Runtime kept of its own across a commit, from the C heap's growth less the
/// adapter's own part of it: that growth plus the most that glibc's per-thread cache can
/// hide of it (see [`crate::heap::THREAD_CACHE_BOUND`]), so the figure is not below what
/// ONNX Runtime holds when nothing else in the process allocates or frees meanwhile.
fn runtime_memory(grown: i64) -> u64 {
    match u64::try_from(grown) {
        Ok(0) | Err(_) => {
            tracing::warn!(
                grown,
                "the C heap shows no growth of onnx runtime's across the commit (other threads freed meanwhile, or \
                 malloc is not glibc's); none is booked"
            );
            0
        }
        Ok(grown) => grown.saturating_add(crate::heap::THREAD_CACHE_BOUND),
    }
}

/// A session whose memory comes from a [`GovernedOrtAllocator`], through a table of
/// its own: every allocation ONNX Runtime makes for it, on any of its threads (intra-op,
/// inter-op, a global pool), is charged to the tenant and counted in the session's
/// [`GovernedSession::stats`]. Run it through [`GovernedSession::run`] (or
/// [`run_with_options`](GovernedSession::run_with_options),
/// [`run_binding`](GovernedSession::run_binding)): a refusal during the run stops it at
/// the next kernel boundary and the error carries the governor's reason.
pub struct GovernedSession {
    /// Released in `Drop`, under the commit lock.
    session: ManuallyDrop<Session>,
    run_options: RunOptions,
    allocator: GovernedOrtAllocator,
    core: Arc<Core>,
    serial: u64,
    shapes: SeenShapes,
}

/// The input shapes a session has run (hashed), so its allocator's cache is trimmed
/// after the first run of each (see [`OrtAllocatorConfig::trim_on_new_shapes`](crate::OrtAllocatorConfig::trim_on_new_shapes)).
/// Bounded: past [`SeenShapes::CAPACITY`] keys it starts over.
#[derive(Default)]
struct SeenShapes(std::collections::HashSet<u64>);

impl SeenShapes {
    const CAPACITY: usize = 256;

    /// The key of `inputs`' element types and dimensions, `None` for inputs that are not
    /// all tensors.
    fn key<const N: usize>(inputs: &SessionInputs<'_, '_, N>) -> Option<u64> {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        let mut hash = |value: &ort::value::Value| match value.dtype() {
            ort::value::ValueType::Tensor { ty, shape, .. } => {
                (*ty as u32).hash(&mut hasher);
                (**shape).hash(&mut hasher);
                Some(())
            }
            _ => None,
        };
        match inputs {
            SessionInputs::ValueMap(values) => values.iter().try_for_each(|(_, value)| hash(value))?,
            SessionInputs::ValueSlice(values) => values.iter().try_for_each(|value| hash(value))?,
            SessionInputs::ValueArray(values) => values.iter().try_for_each(|value| hash(value))?,
        }
        Some(hasher.finish())
    }

    /// Whether `key` is new (and remembers it).
    fn first_run(&mut self, key: u64) -> bool {
        if self.0.len() >= SeenShapes::CAPACITY && !self.0.contains(&key) {
            self.0.clear();
        }
        self.0.insert(key)
    }

    /// The first run of new shape `key` (`None`: not a new shape) is over: a failed one
    /// (refused, stopped) is not the run ONNX Runtime plans the shape's memory from, so
    /// the next run of it allocates each buffer on its own again and must trim again.
    fn ran(&mut self, key: Option<u64>, succeeded: bool) {
        if let (Some(key), false) = (key, succeeded) {
            self.0.remove(&key);
        }
    }
}

impl std::fmt::Debug for GovernedSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GovernedSession")
            .field("serial", &self.serial)
            .field("session", &self.session)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Drop for GovernedSession {
    fn drop(&mut self) {
        // ONNX Runtime frees the session's own memory as it releases it (unless an output
        // still holds it): not while another commit measures the heap.
        #[allow(unsafe_code)]
        // SAFETY: the session is taken exactly once, here, and nothing uses the field
        // after (this is the last thing done with `self.session`).
        let session = unsafe { ManuallyDrop::take(&mut self.session) };
        release(session);
    }
}

/// Releases a session that never became a [`GovernedSession`] (its commit failed after
/// ONNX Runtime created it) under the commit lock, as a governed session is released:
/// ONNX Runtime's frees of its own memory must not show in another commit's measure.
fn release_unwrapped(session: Session) {
    release(session);
}

/// Closes a commit's registration window when dropped (also if the commit panics).
struct CommitWindow<'a> {
    environment: &'a OrtEnvironment,
    core: &'a Arc<Core>,
}

impl Drop for CommitWindow<'_> {
    fn drop(&mut self) {
        let _ = self.core.caller.end();
        self.environment.unregister(self.core);
    }
}

/// Ends a run's phase when dropped (also if the run panics).
struct RunPhase<'c>(&'c Core);

impl RunPhase<'_> {
    fn begin(core: &Core, stop: Option<StopFlag>) -> RunPhase<'_> {
        core.caller.begin(Phase::Running, stop);
        RunPhase(core)
    }

    fn end(self) -> Option<String> {
        let refusal = self.0.caller.end();
        std::mem::forget(self);
        refusal
    }
}

impl Drop for RunPhase<'_> {
    fn drop(&mut self) {
        let _ = self.0.caller.end();
    }
}

impl GovernedSession {
    /// Runs the session.
    ///
    /// ONNX Runtime's tensors do not check the pointer an allocator returns, so a
    /// request the governor refuses during a run is still served while the run is
    /// stopped at its next kernel boundary: from the governor's overdraft (booked per
    /// device and tenant, bounded by the device's overdraft limit), past that from a
    /// scratch sink of fixed size (see the crate docs). Both are freed as the failed run
    /// unwinds; a run that finished anyway has its outputs discarded.
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
        let inputs = inputs.into();
        let new_shape = self.new_shape(&inputs);
        let stop = StopFlag::of(self.run_options.ptr());
        let phase = RunPhase::begin(&self.core, stop);
        let result = self.session.run_with_options(inputs, &self.run_options);
        let refusal = phase.end();
        trim_after(&self.core, self.serial, new_shape);
        let finished = finish(refusal, result);
        self.shapes.ran(new_shape, finished.is_ok());
        finished
    }

    /// Runs the session with the caller's run options (a run tag, a log level, an
    /// output selector, a terminate set from another thread). A refusal sets the
    /// options' terminate flag for the rest of the run and clears it again when the run
    /// returns, so the options can be reused; a terminate of the caller's own fails the
    /// run with [`OrtAdapterError::Runtime`] as ONNX Runtime reports it (one set during a
    /// refused run is cleared with the refusal's, the run being over). Give each
    /// concurrent run options of its own: a refusal terminates every run sharing them.
    ///
    /// # Errors
    /// As [`GovernedSession::run`].
    pub fn run_with_options<'r, 's: 'r, 'i, 'v: 'i, O: SelectedOutputMarker, const N: usize>(
        &'s mut self,
        inputs: impl Into<SessionInputs<'i, 'v, N>>,
        options: &'r RunOptions<O>,
    ) -> Result<SessionOutputs<'r>, OrtAdapterError> {
        let inputs = inputs.into();
        let new_shape = self.new_shape(&inputs);
        let phase = RunPhase::begin(&self.core, StopFlag::of(options.ptr()));
        let result = self.session.run_with_options(inputs, options);
        let refusal = phase.end();
        trim_after(&self.core, self.serial, new_shape);
        let finished = finish(refusal, result);
        self.shapes.ran(new_shape, finished.is_ok());
        finished
    }

    /// The key of `inputs` when they are of shapes this session has not run yet (and the
    /// allocator trims after new shapes).
    fn new_shape<const N: usize>(&mut self, inputs: &SessionInputs<'_, '_, N>) -> Option<u64> {
        if !self.allocator.config().trims_new_shapes() {
            return None;
        }
        SeenShapes::key(inputs).filter(|&key| self.shapes.first_run(key))
    }

    /// An I/O binding for this session: bind inputs and outputs ahead of the run
    /// (outputs bound to the CPU memory info are allocated through the governed table,
    /// like any output), then run it with [`GovernedSession::run_binding`].
    ///
    /// # Errors
    /// [`OrtAdapterError::Runtime`] when ONNX Runtime cannot create the binding.
    pub fn create_binding(&self) -> Result<IoBinding, OrtAdapterError> {
        self.session.create_binding().map_err(|err| runtime("create an io binding", &err))
    }

    /// Runs the session on an I/O binding, with the session's own run options. After a
    /// refused run the binding's outputs are cleared (ONNX Runtime would otherwise keep
    /// the stopped run's output buffers, overdraft or sink memory, and write the next
    /// run's outputs into them): bind them again before the next run. A run on a
    /// binding does not trim after new input shapes (see
    /// [`OrtAllocatorConfig::trim_on_new_shapes`](crate::OrtAllocatorConfig::trim_on_new_shapes)):
    /// the bound inputs' shapes cannot be read back. After the first run of a new shape,
    /// trim the allocator yourself (`session.allocator().binding().allocator().trim()`).
    ///
    /// # Errors
    /// As [`GovernedSession::run`].
    pub fn run_binding<'b, 's: 'b>(
        &'s mut self,
        binding: &'b mut IoBinding,
    ) -> Result<SessionOutputs<'b>, OrtAdapterError> {
        self.run_options.unterminate().map_err(|err| runtime("reset the run options", &err))?;
        let phase = RunPhase::begin(&self.core, StopFlag::of(self.run_options.ptr()));
        let outputs: *mut IoBinding = binding;
        let result = self.session.run_binding_with_options(binding, &self.run_options);
        finish_binding(phase.end(), result, outputs)
    }

    /// Runs the session on an I/O binding with the caller's run options (see
    /// [`GovernedSession::run_with_options`] and [`GovernedSession::run_binding`]).
    ///
    /// # Errors
    /// As [`GovernedSession::run`].
    pub fn run_binding_with_options<'r, 'b, 's: 'b>(
        &'s mut self,
        binding: &'b mut IoBinding,
        options: &'r RunOptions<NoSelectedOutputs>,
    ) -> Result<SessionOutputs<'b>, OrtAdapterError> {
        let phase = RunPhase::begin(&self.core, StopFlag::of(options.ptr()));
        let outputs: *mut IoBinding = binding;
        let result = self.session.run_binding_with_options(binding, options);
        finish_binding(phase.end(), result, outputs)
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

    /// This session's own figures: what ONNX Runtime allocated, holds and was refused
    /// for this session alone (the allocator's [`stats`](GovernedOrtAllocator::stats)
    /// sum every session committed with it). `GetStats` through the session's table
    /// reports the same.
    pub fn stats(&self) -> OrtAllocatorStats {
        self.core.stats()
    }

    /// The process-unique serial of the session (in logs and the caller hold's name).
    pub fn serial(&self) -> u64 {
        self.serial
    }
}

/// After the first run of new shapes: returns what the allocator caches of the buffers
/// ONNX Runtime will not ask for again.
fn trim_after(core: &Core, serial: u64, new_shape: Option<u64>) {
    if new_shape.is_some() {
        let returned = core.blocks.trim_and_return_heap_pages(&core.caller.counters);
        tracing::debug!(serial, returned, "first run of new input shapes: allocator cache trimmed");
    }
}

/// [`finish`] for a run on an I/O binding: a refused run's bound outputs are cleared.
fn finish_binding<'b>(
    refusal: Option<String>,
    result: ort::Result<SessionOutputs<'b>>,
    binding: *mut IoBinding,
) -> Result<SessionOutputs<'b>, OrtAdapterError> {
    let Some(reason) = refusal else { return finish(None, result) };
    // The outputs (the only borrow of the binding made by the run) go first.
    let error = match finish(Some(reason), result.map(drop)) {
        Err(error) => error,
        Ok(()) => OrtAdapterError::Runtime { action: "run", message: "a refused run reported success".to_owned() },
    };
    #[allow(unsafe_code)]
    // SAFETY: `binding` came from the caller's `&'b mut IoBinding`; the run's borrow of it
    // (its outputs) was dropped above, and nothing else borrows it on this path (a
    // refused run returns no outputs), so this is the only access.
    unsafe {
        (*binding).clear_outputs()
    };
    Err(error)
}

/// A run's result, failed with the governor's reason when the run was refused memory
/// (even if ONNX Runtime finished it: its outputs may hold overdraft or sink memory,
/// so they are discarded).
fn finish<T>(refusal: Option<String>, result: ort::Result<T>) -> Result<T, OrtAdapterError> {
    match (result, refusal) {
        (Ok(outputs), None) => Ok(outputs),
        (Ok(outputs), Some(reason)) => {
            drop(outputs);
            Err(OrtAdapterError::Refused {
                action: "run",
                reason,
                runtime: "the run finished on overdraft memory; its outputs were discarded".to_owned(),
            })
        }
        (Err(err), refusal) => Err(explain(refusal, "run", &err.to_string())),
    }
}

fn runtime(action: &'static str, err: &dyn std::fmt::Display) -> OrtAdapterError {
    OrtAdapterError::Runtime { action, message: err.to_string() }
}

/// An ONNX Runtime error, with the governor's reason when a refusal happened during the
/// call (ONNX Runtime only sees a null pointer or a stopped run).
fn explain(refusal: Option<String>, action: &'static str, runtime: &str) -> OrtAdapterError {
    match refusal {
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
