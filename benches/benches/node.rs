//! memory-node benches (issue 27), each against a baseline in the same run:
//! - `node_pair/*`: allocate + release of 4 KiB through a binding over a governed
//!   counter allocator (the governor's cost in full view), with the governor's limits
//!   process-local (`local`) and drawn from node books (`node`), in interleaved
//!   batches (target: node <= 1.2x local). Grants are drawn when a thread's local budget
//!   runs short, so a steady pair touches no shared line.
//! - `node_scaling/*`: the same pair through node books on one thread (`one`), on two
//!   threads of one process (`two_threads`, each with its own binding), and in two
//!   processes at once (`two_processes`: this bench re-executed, each child its own
//!   registry, governor and slot in the same books, started once and told over a pipe
//!   how many pairs to run). Reported as aggregate time per pair (wall time / pairs of
//!   both), so two over one is the throughput ratio; two processes should scale like two
//!   threads. `alu_one` / `alu_two`: arithmetic that shares nothing, the machine's own
//!   scaling in this run.
//!
//! After criterion's own output, a summary prints the median of each bench's measured
//! samples from this run and the ratios.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use criterion::Criterion;
use memory_benches::{CounterAllocator, interleaved};
use memory_governor::{
    AccountConfig, AllocationRequest, BindingRegistry, DeviceAllocator, DeviceKey, Governor, HardLimit, MemoryBinding,
};
use memory_node::{Member, NodeBooks, NodeConfig};

const PAIR_BYTES: usize = 4096;
const DEVICE: DeviceKey = DeviceKey::host(60);
const CHILD: &str = "MEMORY_NODE_BENCH_CHILD";

static SAMPLES: Mutex<BTreeMap<String, Vec<f64>>> = Mutex::new(BTreeMap::new());

fn record(name: &str, elapsed: Duration, ops: u64) {
    let per_op = elapsed.as_secs_f64() * 1e9 / ops.max(1) as f64;
    SAMPLES.lock().unwrap_or_else(std::sync::PoisonError::into_inner).entry(name.to_owned()).or_default().push(per_op);
}

/// One process's stack: a registry and a governor with one tenant over a governed
/// counter allocator; its limits either local or drawn from `books`.
struct Stack {
    registry: BindingRegistry,
    mechanism: memory_governor::MechanismIdentity,
    _governor: Governor,
    _member: Option<Member>,
}

impl Stack {
    fn new(books: Option<&NodeBooks>) -> Stack {
        let registry = BindingRegistry::new();
        let governor = Governor::new();
        let context = registry.register_provider_context(DEVICE, Arc::new("bench")).expect("context");
        let tenant = registry.register_authority(DEVICE, Arc::new("tenant")).expect("authority");
        governor.open_account(AccountConfig::new(DEVICE, tenant).with_label("tenant")).expect("account");
        let allocator: Arc<dyn DeviceAllocator> = Arc::new(CounterAllocator::new(DEVICE));
        let governed = governor.govern(allocator, tenant).expect("govern");
        let mechanism = registry.register_allocator(&context, &tenant, Arc::new(governed)).expect("register");
        let member = books.map(|books| {
            let member = books.join(&governor).expect("join");
            member.govern_device(DEVICE, Arc::new(HardLimit)).expect("govern device");
            member.bind_tenant(tenant, "tenant").expect("bind tenant");
            member
        });
        if member.is_none() {
            governor.set_device_limit(DEVICE, 64 << 30).expect("limit");
        }
        Stack { registry, mechanism, _governor: governor, _member: member }
    }

    fn binding(&self) -> MemoryBinding {
        self.registry.bind_registered(&self.mechanism).expect("bind")
    }
}

fn pair(binding: &MemoryBinding, request: AllocationRequest) {
    let block = binding.allocate(black_box(request)).expect("allocate");
    binding.release(black_box(block)).expect("release");
}

fn request() -> AllocationRequest {
    AllocationRequest::new(PAIR_BYTES, 64).expect("request")
}

fn books_config(name: &str) -> NodeConfig {
    let directory = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm".into() } else { std::env::temp_dir() };
    NodeConfig::new(name).with_directory(directory)
}

fn open_books() -> NodeBooks {
    let books = NodeBooks::open(books_config(&format!("memory-node-bench-{}", std::process::id()))).expect("books");
    books.set_device_limit(DEVICE, 64 << 30).expect("node limit");
    books
}

fn node_pair(c: &mut Criterion, books: &NodeBooks) {
    let (local, node) = (Stack::new(None), Stack::new(Some(books)));
    let (local_binding, node_binding) = (local.binding(), node.binding());
    let request = request();
    c.bench_function("node_pair/local_vs_node", |b| {
        b.iter_custom(|iters| {
            let (local_time, node_time) =
                interleaved(iters, || pair(&local_binding, request), || pair(&node_binding, request));
            record("node_pair/local", local_time, iters);
            record("node_pair/node", node_time, iters);
            (local_time + node_time) / 2
        })
    });
}

/// `iters` pairs on each of `bindings`' threads at once; wall time per pair of all.
fn run_threads(bindings: &[MemoryBinding], iters: u64) -> Duration {
    let barrier = Barrier::new(bindings.len() + 1);
    std::thread::scope(|scope| {
        for binding in bindings {
            let barrier = &barrier;
            scope.spawn(move || {
                let request = request();
                barrier.wait();
                (0..iters).for_each(|_| pair(binding, request));
            });
        }
        barrier.wait();
        let start = Instant::now();
        // The scope joins the threads when it ends.
        start
    })
    .elapsed()
}

/// A child process: its own stack in the same books, running pairs on request.
struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Worker {
    fn spawn(books: &NodeBooks) -> Worker {
        let mut child = Command::new(std::env::current_exe().expect("this bench"))
            .env(CHILD, books.path().file_name().expect("name"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn a bench child");
        let stdin = child.stdin.take().expect("stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut ready = String::new();
        stdout.read_line(&mut ready).expect("the child is ready");
        assert_eq!(ready.trim(), "ready", "the bench child said {ready:?}");
        Worker { child, stdin, stdout }
    }

    fn start(&mut self, iters: u64) {
        writeln!(self.stdin, "{iters}").expect("tell the child");
        self.stdin.flush().expect("flush");
    }

    /// When the child started and ended its pairs (nanoseconds of the wall clock).
    fn finish(&mut self) -> (u64, u64) {
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("the child answers");
        let mut parts = line.split_whitespace().map(|n| n.parse::<u64>().expect("nanoseconds"));
        (parts.next().expect("start"), parts.next().expect("end"))
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "0");
        let _ = self.child.wait();
    }
}

/// Nanoseconds of the wall clock now, which the processes share (a span of a few
/// milliseconds is what is measured).
fn clock_nanos() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// The child's side: join the books, say ready, run the pairs asked for.
fn child(name: &str) {
    let books = NodeBooks::open_existing(books_config(name)).expect("the parent's books");
    let stack = Stack::new(Some(&books));
    let binding = stack.binding();
    let request = request();
    // Warm the thread's credit and records.
    (0..1000).for_each(|_| pair(&binding, request));
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready").expect("stdout");
    out.flush().expect("flush");
    for line in std::io::stdin().lock().lines() {
        let iters: u64 = line.expect("stdin").trim().parse().expect("a count");
        if iters == 0 {
            break;
        }
        let start = clock_nanos();
        (0..iters).for_each(|_| pair(&binding, request));
        let end = clock_nanos();
        writeln!(out, "{start} {end}").expect("stdout");
        out.flush().expect("flush");
    }
}

fn node_scaling(c: &mut Criterion, books: &NodeBooks) {
    let stack = Stack::new(Some(books));
    let one = [stack.binding()];
    let two = [stack.binding(), stack.binding()];
    let mut group = c.benchmark_group("node_scaling");
    group.bench_function("one", |b| {
        b.iter_custom(|iters| {
            let elapsed = run_threads(&one, iters);
            record("node_scaling/one", elapsed, iters);
            elapsed
        })
    });
    group.bench_function("two_threads", |b| {
        b.iter_custom(|iters| {
            let elapsed = run_threads(&two, iters);
            record("node_scaling/two_threads", elapsed, 2 * iters);
            elapsed / 2
        })
    });
    // The machine's own scaling in this run: an ALU loop that shares nothing.
    for (name, threads) in [("alu_one", 1u64), ("alu_two", 2)] {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                std::thread::scope(|scope| {
                    for _ in 0..threads {
                        scope.spawn(|| alu(iters));
                    }
                });
                let elapsed = start.elapsed();
                record(&format!("node_scaling/{name}"), elapsed, threads * iters);
                elapsed / threads as u32
            })
        });
    }
    let mut workers = [Worker::spawn(books), Worker::spawn(books)];
    group.bench_function("two_processes", |b| {
        b.iter_custom(|iters| {
            workers.iter_mut().for_each(|worker| worker.start(iters));
            let spans: Vec<_> = workers.iter_mut().map(Worker::finish).collect();
            let start = spans.iter().map(|s| s.0).min().expect("two");
            let end = spans.iter().map(|s| s.1).max().expect("two");
            let elapsed = Duration::from_nanos(end.saturating_sub(start));
            record("node_scaling/two_processes", elapsed, 2 * iters);
            elapsed / 2
        })
    });
    group.finish();
}

/// About a pair's time of arithmetic per iteration, touching no memory.
fn alu(iters: u64) {
    let mut x = black_box(1u64);
    for _ in 0..iters {
        for _ in 0..48 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        }
        x = black_box(x);
    }
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

fn summary() {
    const SAMPLE_SIZE: usize = 100;
    let samples = SAMPLES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let measured = |name: &str| -> f64 {
        let all = samples.get(name).map(Vec::as_slice).unwrap_or_default();
        median(&all[all.len().saturating_sub(SAMPLE_SIZE)..])
    };
    let (local, node) = (measured("node_pair/local"), measured("node_pair/node"));
    let (one, threads, processes) =
        (measured("node_scaling/one"), measured("node_scaling/two_threads"), measured("node_scaling/two_processes"));
    println!("\nnode summary (medians of this run's measured samples):");
    println!(
        "  governed pair over counter, process-local {local:>7.1} ns   through node books {node:>7.1} ns   node/local = {:.2}x (target <= 1.2x)",
        node / local
    );
    println!("  pairs through node books, 1 thread        {one:>7.1} ns/pair");
    println!(
        "  2 threads of one process                  {threads:>7.1} ns/pair aggregate   2 threads / 1 thread throughput = {:.2}x",
        one / threads
    );
    let alu = measured("node_scaling/alu_one") / measured("node_scaling/alu_two");
    println!("  an ALU loop sharing nothing, 2 threads / 1 thread throughput = {alu:.2}x (the machine's scaling now)");
    println!(
        "  2 processes at once                       {processes:>7.1} ns/pair aggregate   2 processes / 1 thread throughput = {:.2}x   2 processes / 2 threads = {:.2}x (target ~1x)",
        one / processes,
        threads / processes
    );
}

fn main() {
    if let Some(name) = std::env::var_os(CHILD) {
        child(&name.to_string_lossy());
        return;
    }
    let books = open_books();
    let mut criterion = Criterion::default().configure_from_args();
    node_pair(&mut criterion, &books);
    node_scaling(&mut criterion, &books);
    criterion.final_summary();
    summary();
    let _ = std::fs::remove_file(books.path());
}
