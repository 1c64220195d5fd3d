//! The page: self-contained (nothing fetched), its data cannot close its script, and in a
//! real headless browser (Chromium) it loads with no script error, draws the expected
//! series, refusals and marks for a known trace, and a screenshot is produced.
//!
//! The browser is `$MEMORY_TRACE_BROWSER`, else the first of `chromium`,
//! `chromium-browser`, `google-chrome` on `PATH`. Without one the browser tests print
//! `skipped <test>: ...` and pass, unless `MEMORY_TRACE_BROWSER_REQUIRED=1` (CI's
//! `.ci/run` sets it once it has installed Chromium), when they fail.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use memory_trace::replay::{self, AllocatorKind, ReplayConfig};
use memory_trace::{Trace, html, read_trace};

fn synthetic() -> Trace {
    read_trace(&synthetic_bytes()[..]).unwrap()
}

fn page(trace: &Trace) -> String {
    let configs = [
        ReplayConfig::new(AllocatorKind::System),
        ReplayConfig::new(AllocatorKind::Pooled),
        "virtual@200MiB".parse().unwrap(),
    ];
    html::report("synthetic", trace, &replay::replay_all(trace, &configs))
}

/// The JSON the page embeds.
fn embedded(page: &str) -> serde_json::Value {
    let start = page.find(r#"<script type="application/json" id="data">"#).unwrap();
    let rest = &page[start..];
    let body = &rest[rest.find('>').unwrap() + 1..rest.find("</script>").unwrap()];
    serde_json::from_str(body).expect("the embedded data is JSON")
}

#[test]
fn the_page_is_one_self_contained_file() {
    let page = page(&synthetic());
    for fetch in ["<link", " src=", "@import", "fetch(", "XMLHttpRequest", "https://"] {
        assert!(!page.contains(fetch), "the page fetches something: {fetch}");
    }
    // The one URL is SVG's namespace, which is a name, not a request.
    assert_eq!(page.matches("http://").count(), 1);
    assert!(page.contains("http://www.w3.org/2000/svg"));
    let data = embedded(&page);
    assert_eq!(data["configs"].as_array().unwrap().len(), 3);
    assert_eq!(data["configs"][2]["label"], "virtual @ 200.0 MiB");
    let device = &data["configs"][0]["devices"][0];
    assert_eq!(device["series"].as_array().unwrap().len(), device["allocated"].as_array().unwrap().len());
    assert_eq!(device["ts"].as_array().unwrap().len(), device["reserved"].as_array().unwrap().len());
    assert!(data["marks"].as_array().unwrap().iter().any(|mark| mark["kind"] == "device-lost"));
}

#[test]
fn a_label_cannot_close_the_pages_scripts() {
    let mut trace = synthetic();
    trace.tenants[0].label = "</script><script>alert(1)</script>".into();
    let page =
        html::report("</title><b>", &trace, &[replay::replay(&trace, &ReplayConfig::new(AllocatorKind::System))]);
    assert_eq!(page.matches("</script>").count(), 2, "only the page's own two scripts close");
    assert!(page.contains("<title>&lt;/title&gt;&lt;b&gt;</title>"));
    assert_eq!(embedded(&page)["tenants"][0], "</script><script>alert(1)</script>");
}

/// `<!--` then `<script` inside a script element puts the HTML parser in the script's
/// double-escaped state: the element's own `</script>` no longer closes it, it swallows
/// the page's script, and the page stays at "loading". Escaping only `</` left that
/// open to a label such as a note "<!--<script>".
#[test]
fn a_label_cannot_put_the_data_script_in_its_double_escaped_state() {
    let mut trace = synthetic();
    trace.tenants[1].label = "<!--<script>".into();
    let page = html::report("t", &trace, &[replay::replay(&trace, &ReplayConfig::new(AllocatorKind::System))]);
    let start = page.find(r#"<script type="application/json" id="data">"#).unwrap();
    let data = &page[start + r#"<script type="application/json" id="data">"#.len()..];
    let data = &data[..data.find("</script>").unwrap()];
    assert!(!data.contains('<'), "no tag opens inside the data: {}", &data[..data.len().min(200)]);
    assert_eq!(embedded(&page)["tenants"][1], "<!--<script>", "the label is intact in the JSON");
    assert_eq!(page.matches("<script").count(), 2, "the page's own two scripts only");
}

/// The browser to run, or why there is none (after saying so, unless one is required).
fn browser(test: &str) -> Option<PathBuf> {
    let required = std::env::var_os("MEMORY_TRACE_BROWSER_REQUIRED").is_some_and(|value| value == "1");
    let candidates: Vec<PathBuf> = match std::env::var_os("MEMORY_TRACE_BROWSER") {
        Some(path) => vec![PathBuf::from(path)],
        None => {
            let path = std::env::var_os("PATH").unwrap_or_default();
            ["chromium", "chromium-browser", "google-chrome"]
                .iter()
                .flat_map(|name| std::env::split_paths(&path).map(move |dir| dir.join(name)))
                .collect()
        }
    };
    match candidates.into_iter().find(|candidate| candidate.is_file()) {
        Some(found) => Some(found),
        None if required => panic!("{test}: MEMORY_TRACE_BROWSER_REQUIRED=1 but no Chromium was found"),
        None => {
            eprintln!(
                "skipped {test}: no headless browser (install Debian's chromium: apt-get install chromium, or set \
                 MEMORY_TRACE_BROWSER)"
            );
            None
        }
    }
}

/// Runs the browser headless on `page` with `args`; its stdout.
fn headless(browser: &Path, page: &Path, args: &[String]) -> String {
    let profile = tempdir("profile");
    let mut child = Command::new(browser)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(format!("file://{}", page.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the browser starts");
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut out = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut out).map(|_| out)
    });
    loop {
        match child.try_wait().unwrap() {
            Some(_) => break,
            None if Instant::now() > deadline => {
                let _ = child.kill();
                panic!("the browser did not finish within 90 s");
            }
            None => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    let _ = std::fs::remove_dir_all(&profile);
    reader.join().unwrap().expect("the browser's output is text")
}

fn tempdir(what: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("memory-trace-html-{}-{what}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write_page() -> (PathBuf, Trace) {
    let trace = synthetic();
    let dir = tempdir("page");
    let path = dir.join("report.html");
    std::fs::write(&path, page(&trace)).unwrap();
    (path, trace)
}

#[test]
fn in_headless_chromium_the_page_loads_without_error_and_draws_the_series_of_a_known_trace() {
    let Some(browser) =
        browser("in_headless_chromium_the_page_loads_without_error_and_draws_the_series_of_a_known_trace")
    else {
        return;
    };
    let (path, trace) = write_page();
    let dom = headless(&browser, &path, &["--dump-dom".to_owned()]);
    let status = dom.split(r#"<p id="status""#).nth(1).and_then(|rest| rest.split("</p>").next()).unwrap_or_default();
    assert!(status.contains(r#"data-status="ok""#), "the page's script failed: {status}");
    let report = replay::replay(&trace, &ReplayConfig::new(AllocatorKind::System));
    let series = report.devices[0].series.len();
    assert!(status.contains(&format!("ok: drew {series} series, 3 configurations")), "{status}");
    for expected in ["chat/weights", "embed/weights", "chat/kv-cache", "chat/activations", "embed/workspace"] {
        assert!(dom.contains(&format!(r#"data-series="{expected}""#)), "no area for {expected}");
    }
    assert_eq!(dom.matches(r#"class="area""#).count(), series);
    for config in ["system", "pooled", "virtual @ 200.0 MiB"] {
        assert!(dom.contains(&format!(r#"class="reserved" data-config="{config}""#)), "no reserved line for {config}");
    }
    assert!(dom.contains(r#"class="refusal" data-config="virtual @ 200.0 MiB""#), "the tighter limit's refusals");
    assert!(dom.contains(r#"data-kind="device-lost""#) && dom.contains(r#"data-kind="recorded-refusal""#));
    assert!(dom.contains("Largest allocations live at the peak") && dom.contains("first refused event"));
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn in_headless_chromium_a_screenshot_of_the_page_is_produced() {
    let Some(browser) = browser("in_headless_chromium_a_screenshot_of_the_page_is_produced") else {
        return;
    };
    let (path, _) = write_page();
    let png = path.with_file_name("report.png");
    headless(&browser, &path, &[format!("--screenshot={}", png.display()), "--window-size=1200,1100".to_owned()]);
    let bytes = std::fs::read(&png).expect("the browser wrote a screenshot");
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert!(bytes.len() > 20_000, "a drawn page, not a blank one: {} bytes", bytes.len());
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

/// The issue's "done when": the trace `demo --ort` recorded (real models through ONNX
/// Runtime, `traces/demo-ort.mtrace`) replays against three allocator configurations
/// with a side-by-side table, and its page renders in a headless browser.
#[test]
fn the_demo_ort_trace_replays_on_three_stacks_side_by_side_and_its_page_renders_in_headless_chromium() {
    let test = "the_demo_ort_trace_replays_on_three_stacks_side_by_side_and_its_page_renders_in_headless_chromium";
    let trace = read_trace(std::fs::File::open(trace_path("demo-ort.mtrace")).unwrap()).unwrap();
    let configs: Vec<ReplayConfig> = AllocatorKind::ALL.iter().copied().map(ReplayConfig::new).collect();
    let reports = replay::replay_all(&trace, &configs);
    let text = replay::table(&trace, &reports);
    let header = text.lines().find(|line| line.starts_with("host")).unwrap_or_else(|| panic!("no host table:\n{text}"));
    for name in ["system", "pooled", "virtual"] {
        assert!(header.contains(name), "{header}");
    }
    let device = &reports[0].devices[0];
    let labels: Vec<String> =
        device.series.iter().map(|(tenant, role)| format!("{}/{}", trace.tenant_label(*tenant), role.name())).collect();
    for tenant in ["voice", "scan"] {
        assert!(labels.iter().any(|label| label.starts_with(&format!("{tenant}/"))), "{tenant}: {labels:?}");
    }
    let page = html::report("demo --ort", &trace, &reports);
    assert_eq!(embedded(&page)["configs"].as_array().unwrap().len(), 3);
    let Some(browser) = browser(test) else {
        return;
    };
    let dir = tempdir("ort");
    let path = dir.join("report.html");
    std::fs::write(&path, &page).unwrap();
    let dom = headless(&browser, &path, &["--dump-dom".to_owned()]);
    let status = dom.split(r#"<p id="status""#).nth(1).and_then(|rest| rest.split("</p>").next()).unwrap_or_default();
    assert!(status.contains(r#"data-status="ok""#), "the page's script failed: {status}");
    assert!(status.contains(&format!("ok: drew {} series, 3 configurations", labels.len())), "{status}");
    for label in &labels {
        assert!(dom.contains(&format!(r#"data-series="{label}""#)), "no area for {label}");
    }
    for config in ["system", "pooled", "virtual"] {
        assert!(dom.contains(&format!(r#"class="reserved" data-config="{config}""#)), "no reserved line for {config}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
