//! Where the ONNX Runtime library and the real models are found: the cache that
//! `cargo xtask test` (and `demo --ort`, `bench --ort`) fill from the Python wheels
//! that ship them. Nothing here downloads; a missing file is a typed error that says
//! how to fetch it.

use std::path::{Path, PathBuf};

use crate::error::OrtAdapterError;

/// The environment variable naming the cache directory (xtask sets it).
pub const CACHE_ENV: &str = "MEMORY_ORT_CACHE";

/// The environment variable that makes a missing asset a test failure rather than a
/// skip (xtask sets it to `1`, so `cargo xtask test` never skips the real-model tests).
pub const REQUIRED_ENV: &str = "MEMORY_ORT_REQUIRED";

/// The ONNX Runtime release the adapter is built and tested against.
pub const ONNXRUNTIME_VERSION: &str = "1.31.1";

/// The cache's files, relative to its root.
pub const LIBRARY_FILE: &str = "lib/libonnxruntime.so.1.31.1";
/// Silero VAD 6.2.3's streaming voice-activity model.
pub const SILERO_VAD_FILE: &str = "models/silero_vad.onnx";
/// RapidOCR 1.4.4's PP-OCRv4 text-detection model.
pub const OCR_DET_FILE: &str = "models/ch_PP-OCRv4_det_infer.onnx";
/// RapidOCR 1.4.4's PP-OCRv4 text-recognition model (input `[batch, 3, 48, width]`).
pub const OCR_REC_FILE: &str = "models/ch_PP-OCRv4_rec_infer.onnx";
/// RapidOCR 1.4.4's PP-OCR text-direction classifier (input `[batch, 3, 48, 192]`).
pub const OCR_CLS_FILE: &str = "models/ch_ppocr_mobile_v2.0_cls_infer.onnx";

/// The command that fills the cache by hand (what xtask runs).
pub const FETCH_HINT: &str = "run `cargo xtask test` (it fetches them into target/ort-cache), or by hand: python3 -m \
                              pip download --no-deps onnxruntime==1.31.1 silero-vad==6.2.3 \
                              rapidocr-onnxruntime==1.4.4 -d target/ort-cache/wheels, then `python3 \
                              scripts/ort_fetch.py target/ort-cache` extracts them (a cache filled before a model was \
                              added needs only that second step: the wheels already hold it)";

/// The located files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OrtAssets {
    /// The cache directory.
    pub root: PathBuf,
    /// `libonnxruntime.so`.
    pub library: PathBuf,
    /// `silero_vad.onnx`.
    pub silero_vad: PathBuf,
    /// `ch_PP-OCRv4_det_infer.onnx`.
    pub ocr_det: PathBuf,
    /// `ch_PP-OCRv4_rec_infer.onnx`.
    pub ocr_rec: PathBuf,
    /// `ch_ppocr_mobile_v2.0_cls_infer.onnx`.
    pub ocr_cls: PathBuf,
}

impl OrtAssets {
    /// The cache root: `$MEMORY_ORT_CACHE`, else the workspace's `target/ort-cache`.
    pub fn root() -> PathBuf {
        match std::env::var_os(CACHE_ENV) {
            Some(dir) if !dir.is_empty() => PathBuf::from(dir),
            _ => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/ort-cache"),
        }
    }

    /// The files under [`OrtAssets::root`], each checked to exist.
    ///
    /// # Errors
    /// [`OrtAdapterError::MissingAsset`] naming the first missing file and how to fetch it.
    pub fn locate() -> Result<OrtAssets, OrtAdapterError> {
        OrtAssets::locate_in(&OrtAssets::root())
    }

    /// The files under `root`, each checked to exist.
    ///
    /// # Errors
    /// As [`OrtAssets::locate`].
    pub fn locate_in(root: &Path) -> Result<OrtAssets, OrtAdapterError> {
        let assets = OrtAssets {
            root: root.to_path_buf(),
            library: root.join(LIBRARY_FILE),
            silero_vad: root.join(SILERO_VAD_FILE),
            ocr_det: root.join(OCR_DET_FILE),
            ocr_rec: root.join(OCR_REC_FILE),
            ocr_cls: root.join(OCR_CLS_FILE),
        };
        for (what, path) in [
            ("the onnx runtime library", &assets.library),
            ("the silero vad model", &assets.silero_vad),
            ("the pp-ocrv4 detection model", &assets.ocr_det),
            ("the pp-ocrv4 recognition model", &assets.ocr_rec),
            ("the pp-ocr direction classifier", &assets.ocr_cls),
        ] {
            if !path.is_file() {
                return Err(OrtAdapterError::MissingAsset {
                    what,
                    path: path.display().to_string(),
                    hint: FETCH_HINT.to_owned(),
                });
            }
        }
        Ok(assets)
    }

    /// Whether missing assets must fail (`$MEMORY_ORT_REQUIRED` is set and not `0`).
    pub fn required() -> bool {
        std::env::var(REQUIRED_ENV).is_ok_and(|value| !value.is_empty() && value != "0")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_asset_names_the_file_and_the_fetch_command() {
        let dir = std::env::temp_dir().join(format!("memory-ort-empty-{}", std::process::id()));
        let err = OrtAssets::locate_in(&dir).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("onnx runtime library") && text.contains(LIBRARY_FILE), "{text}");
        assert!(text.contains("cargo xtask test") && text.contains("pip download"), "{text}");
    }

    #[test]
    fn a_cache_without_the_recognition_model_names_it_and_the_extract_step() {
        // A cache filled before the recognition and classifier models were added: the
        // runtime and the first two models are there, the wheel holds the rest.
        let dir = std::env::temp_dir().join(format!("memory-ort-partial-{}", std::process::id()));
        for file in [LIBRARY_FILE, SILERO_VAD_FILE, OCR_DET_FILE] {
            let path = dir.join(file);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, b"x").unwrap();
        }
        let err = OrtAssets::locate_in(&dir).unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            matches!(&err, OrtAdapterError::MissingAsset { what: "the pp-ocrv4 recognition model", path, .. }
                if path.ends_with(OCR_REC_FILE)),
            "{err}"
        );
        assert!(err.to_string().contains("scripts/ort_fetch.py"), "{err}");
    }
}
