#!/usr/bin/env python3
"""Fetches ONNX Runtime and the real models for memory-ort's tests, demo and bench.

Downloads the pinned wheels with pip (no dependencies) into CACHE/wheels and extracts
the runtime library and four models into CACHE/lib and CACHE/models (the three
PP-OCR models all come from the one RapidOCR wheel, downloaded once). Run by
`cargo xtask test` (and `demo --ort`, `bench --ort`); a second run finds everything in
place and downloads nothing. On failure it prints one line with the command to retry.
"""
import glob
import os
import shutil
import subprocess
import sys
import zipfile

# (pip requirement, wheel name prefix, member inside the wheel, destination in the cache)
PINS = [
    ("onnxruntime==1.31.1", "onnxruntime-1.31.1-",
     "onnxruntime/capi/libonnxruntime.so.1.31.1", "lib/libonnxruntime.so.1.31.1"),
    ("silero-vad==6.2.3", "silero_vad-6.2.3-",
     "silero_vad/data/silero_vad.onnx", "models/silero_vad.onnx"),
    ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime-1.4.4-",
     "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx", "models/ch_PP-OCRv4_det_infer.onnx"),
    ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime-1.4.4-",
     "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx", "models/ch_PP-OCRv4_rec_infer.onnx"),
    ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime-1.4.4-",
     "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
     "models/ch_ppocr_mobile_v2.0_cls_infer.onnx"),
]


def fail(message):
    print(f"ort-fetch: {message}", flush=True)
    sys.exit(1)


def main():
    cache = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "target/ort-cache")
    wheels = os.path.join(cache, "wheels")
    os.makedirs(wheels, exist_ok=True)
    fetched = 0
    for requirement, prefix, member, destination in PINS:
        target = os.path.join(cache, destination)
        if os.path.isfile(target) and os.path.getsize(target) > 0:
            continue
        found = glob.glob(os.path.join(wheels, prefix + "*.whl"))
        retry = f"python3 -m pip download --no-deps {requirement} -d {wheels}"
        if not found:
            result = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", requirement, "-d", wheels],
                capture_output=True, text=True)
            found = glob.glob(os.path.join(wheels, prefix + "*.whl"))
            if result.returncode != 0 or not found:
                said = (result.stderr.strip().splitlines() or ["no wheel"])[-1]
                fail(f"could not download {requirement} ({said}); retry with: {retry}")
            fetched += 1
        try:
            with zipfile.ZipFile(found[0]) as wheel, wheel.open(member) as source:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                partial = target + ".partial"
                with open(partial, "wb") as sink:
                    shutil.copyfileobj(source, sink)
                os.replace(partial, target)
        except (KeyError, zipfile.BadZipFile, OSError) as error:
            fail(f"could not extract {member} from {os.path.basename(found[0])} ({error}); "
                 f"delete it and retry with: {retry}")
    print(f"ort-fetch: onnx runtime 1.31.1 and the models are in {cache} ({fetched} wheels downloaded)")


if __name__ == "__main__":
    main()
