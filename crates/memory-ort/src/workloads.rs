//! The real models' workloads, shared by the tests, `cargo xtask demo --ort` and
//! `cargo xtask bench --ort`: a Silero VAD stream (16 kHz audio in 512-sample chunks,
//! the recurrent state carried from chunk to chunk), PP-OCRv4 text detection on
//! images of any size, PP-OCRv4 text recognition on batches of text lines of any width
//! and the PP-OCR direction classifier on batches of fixed-size lines. Inputs are
//! synthetic and deterministic (a seed), so two runs can be compared value for value.

use std::borrow::Cow;

use ort::session::{Session, SessionInputValue, SessionOutputs};
use ort::value::Tensor;

use crate::environment::GovernedSession;
use crate::error::OrtAdapterError;

/// Named inputs, as `ort::inputs!["name" => value]` builds them.
pub type NamedInputs<'v> = Vec<(Cow<'static, str>, SessionInputValue<'v>)>;

/// A session the workloads can run: a governed one, or a plain `ort` session (the
/// baseline the outputs are compared with).
pub trait Infer {
    /// Runs the model on named inputs.
    ///
    /// # Errors
    /// The session's error.
    fn infer<'s>(&'s mut self, inputs: NamedInputs<'_>) -> Result<SessionOutputs<'s>, OrtAdapterError>;
}

impl Infer for Session {
    fn infer<'s>(&'s mut self, inputs: NamedInputs<'_>) -> Result<SessionOutputs<'s>, OrtAdapterError> {
        self.run(inputs).map_err(|err| OrtAdapterError::Runtime { action: "run", message: err.to_string() })
    }
}

impl Infer for GovernedSession {
    fn infer<'s>(&'s mut self, inputs: NamedInputs<'_>) -> Result<SessionOutputs<'s>, OrtAdapterError> {
        self.run(inputs)
    }
}

fn input_error(err: ort::Error) -> OrtAdapterError {
    OrtAdapterError::Runtime { action: "build an input tensor", message: err.to_string() }
}

fn output_error(err: ort::Error) -> OrtAdapterError {
    OrtAdapterError::Runtime { action: "read an output tensor", message: err.to_string() }
}

/// Samples per VAD chunk at 16 kHz.
pub const VAD_CHUNK: usize = 512;
/// Samples of the previous chunk the model sees before each chunk.
pub const VAD_CONTEXT: usize = 64;
const VAD_STATE: usize = 2 * 128;
const SAMPLE_RATE: i64 = 16_000;

/// One audio stream through the VAD model: its recurrent state and context.
#[derive(Clone, Debug)]
pub struct VadStream {
    seed: u64,
    position: u64,
    state: Vec<f32>,
    context: Vec<f32>,
}

impl VadStream {
    /// A new stream of synthetic audio named by `seed`.
    pub fn new(seed: u64) -> VadStream {
        VadStream { seed, position: 0, state: vec![0.0; VAD_STATE], context: vec![0.0; VAD_CONTEXT] }
    }

    /// The next chunk of audio: bursts of voiced harmonics with noise, silence between.
    pub fn next_chunk(&mut self) -> Vec<f32> {
        let chunk: Vec<f32> = (0..VAD_CHUNK as u64)
            .map(|i| {
                let t = self.position + i;
                let voiced = !(t / 8_000 + self.seed).is_multiple_of(3);
                let noise = (hash(self.seed ^ t) % 2001) as f32 / 1000.0 - 1.0;
                let tone = if voiced {
                    let f = 140.0 + 30.0 * (self.seed % 5) as f32;
                    let phase = t as f32 / SAMPLE_RATE as f32 * std::f32::consts::TAU;
                    (1..6).map(|h| (phase * f * h as f32).sin() / h as f32).sum::<f32>() * 0.3
                } else {
                    0.0
                };
                tone + noise * 0.01
            })
            .collect();
        self.position += VAD_CHUNK as u64;
        chunk
    }

    /// Runs one chunk, returns the speech probability, and carries the state forward.
    ///
    /// # Errors
    /// The session's error, or [`OrtAdapterError::Runtime`] for a chunk shorter than
    /// [`VAD_CONTEXT`] samples (the next chunk's context) or a model whose state output
    /// is not the stream's size; the stream is unchanged then.
    pub fn step(&mut self, session: &mut impl Infer, chunk: &[f32]) -> Result<f32, OrtAdapterError> {
        if chunk.len() < VAD_CONTEXT {
            return Err(OrtAdapterError::Runtime {
                action: "build an input tensor",
                message: format!(
                    "a VAD chunk of {} samples is shorter than the {VAD_CONTEXT} samples of context the next chunk \
                     needs; pass chunks of {VAD_CHUNK} samples (at {SAMPLE_RATE} Hz)",
                    chunk.len()
                ),
            });
        }
        let mut input = Vec::with_capacity(VAD_CONTEXT + chunk.len());
        input.extend_from_slice(&self.context);
        input.extend_from_slice(chunk);
        let input = Tensor::from_array(([1usize, input.len()], input)).map_err(input_error)?;
        let state = Tensor::from_array(([2usize, 1, 128], self.state.clone())).map_err(input_error)?;
        let rate = Tensor::from_array((Vec::<usize>::new(), vec![SAMPLE_RATE])).map_err(input_error)?;
        let outputs = session.infer(ort::inputs!["input" => input, "state" => state, "sr" => rate])?;
        let (_, probability) = outputs["output"].try_extract_tensor::<f32>().map_err(output_error)?;
        let probability = probability.first().copied().unwrap_or(0.0);
        let (_, state) = outputs["stateN"].try_extract_tensor::<f32>().map_err(output_error)?;
        let Some(state) = state.get(..VAD_STATE) else {
            return Err(OrtAdapterError::Runtime {
                action: "read an output tensor",
                message: format!(
                    "the model's `stateN` holds {} values where a Silero VAD stream carries {VAD_STATE}; \
                     use a Silero VAD v5 export",
                    state.len()
                ),
            });
        };
        self.state.copy_from_slice(state);
        self.context.copy_from_slice(&chunk[chunk.len() - VAD_CONTEXT..]);
        Ok(probability)
    }
}

/// A synthetic page of `height` x `width` pixels (multiples of 32), normalised the way
/// PP-OCR expects (`(x / 255 - 0.5) / 0.5` per channel), as `[1, 3, height, width]`.
pub fn ocr_image(seed: u64, height: usize, width: usize) -> Vec<f32> {
    let mut image = vec![1.0f32; 3 * height * width];
    // Dark "text lines": rows of short dark boxes.
    let line_height = 12 + (seed % 8) as usize;
    let mut y = 16;
    let mut line = 0u64;
    while y + line_height < height {
        let mut x = 16 + (hash(seed ^ line) % 24) as usize;
        while x + 8 < width {
            let word = 10 + (hash(seed ^ line ^ x as u64) % 40) as usize;
            for row in y..(y + line_height).min(height) {
                for col in x..(x + word).min(width - 8) {
                    for channel in 0..3 {
                        image[(channel * height + row) * width + col] = -0.9;
                    }
                }
            }
            x += word + 8;
        }
        y += line_height * 2;
        line += 1;
    }
    image
}

/// Runs text detection on one image; returns the number of pixels whose text
/// probability exceeds 0.3 and the probability map.
///
/// # Errors
/// ONNX Runtime's error.
pub fn detect_text(
    session: &mut impl Infer,
    image: Vec<f32>,
    height: usize,
    width: usize,
) -> Result<(usize, Vec<f32>), OrtAdapterError> {
    let input = Tensor::from_array(([1usize, 3, height, width], image)).map_err(input_error)?;
    let outputs = session.infer(ort::inputs!["x" => input])?;
    let (_, map) = outputs[0].try_extract_tensor::<f32>().map_err(output_error)?;
    let text_pixels = map.iter().filter(|&&p| p > 0.3).count();
    Ok((text_pixels, map.to_vec()))
}

/// The height of a text line, as PP-OCR's recognition and direction models take it.
pub const OCR_LINE_HEIGHT: usize = 48;
/// The width of a text line the direction classifier takes.
pub const OCR_CLS_WIDTH: usize = 192;

/// A batch of `batch` synthetic text lines, `OCR_LINE_HEIGHT` x `width` pixels each,
/// normalised as PP-OCR expects, as `[batch, 3, 48, width]`: glyph-like dark strokes
/// (bars, boxes and gaps of seeded widths) on a light background, a different line
/// per batch element.
pub fn ocr_lines(seed: u64, batch: usize, width: usize) -> Vec<f32> {
    let height = OCR_LINE_HEIGHT;
    let mut lines = vec![1.0f32; batch * 3 * height * width];
    for item in 0..batch {
        let line_seed = hash(seed ^ (item as u64).wrapping_mul(0x5851_f42d_4c95_7f2d));
        let image = &mut lines[item * 3 * height * width..(item + 1) * 3 * height * width];
        let (top, bottom) = (8 + (line_seed % 4) as usize, height - 8 - (line_seed % 3) as usize);
        let mut x = 2 + (line_seed % 6) as usize;
        let mut glyph = 0u64;
        while x + 4 < width {
            let g = hash(line_seed ^ glyph);
            let glyph_width = 6 + (g % 14) as usize;
            let stroke = 2 + ((g >> 8) % 3) as usize;
            let shade = -0.95 + ((g >> 16) % 20) as f32 / 100.0;
            for col in x..(x + glyph_width).min(width) {
                let dx = col - x;
                for row in top..bottom {
                    let dy = row - top;
                    // A glyph: vertical bars at its edges, a bar across its top, middle
                    // or bottom, by the glyph's hash.
                    let bar = dx < stroke || dx + stroke >= glyph_width;
                    let across = match (g >> 24) % 3 {
                        0 => dy < stroke,
                        1 => dy.abs_diff((bottom - top) / 2) < stroke / 2 + 1,
                        _ => dy + stroke >= bottom - top,
                    };
                    if bar || across {
                        for channel in 0..3 {
                            image[(channel * height + row) * width + col] = shade;
                        }
                    }
                }
            }
            x += glyph_width + 2 + ((g >> 32) % 10) as usize;
            glyph += 1;
        }
    }
    lines
}

/// Runs text recognition (PP-OCRv4 rec) on a batch of lines from [`ocr_lines`];
/// returns the output's shape (`[batch, width / 8, classes]`) and its values (per time
/// step, each class's probability).
///
/// # Errors
/// ONNX Runtime's error.
pub fn recognize_text(
    session: &mut impl Infer,
    lines: Vec<f32>,
    batch: usize,
    width: usize,
) -> Result<(Vec<i64>, Vec<f32>), OrtAdapterError> {
    let input = Tensor::from_array(([batch, 3, OCR_LINE_HEIGHT, width], lines)).map_err(input_error)?;
    let outputs = session.infer(ort::inputs!["x" => input])?;
    let (shape, values) = outputs[0].try_extract_tensor::<f32>().map_err(output_error)?;
    Ok((shape.to_vec(), values.to_vec()))
}

/// Runs the direction classifier on a batch of lines from [`ocr_lines`] of width
/// [`OCR_CLS_WIDTH`]; returns `[batch, 2]` probabilities (upright, turned 180°).
///
/// # Errors
/// ONNX Runtime's error.
pub fn classify_direction(
    session: &mut impl Infer,
    lines: Vec<f32>,
    batch: usize,
) -> Result<Vec<f32>, OrtAdapterError> {
    let input = Tensor::from_array(([batch, 3, OCR_LINE_HEIGHT, OCR_CLS_WIDTH], lines)).map_err(input_error)?;
    let outputs = session.infer(ort::inputs!["x" => input])?;
    let (_, values) = outputs[0].try_extract_tensor::<f32>().map_err(output_error)?;
    Ok(values.to_vec())
}

/// A small deterministic hash (splitmix64).
fn hash(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_are_deterministic_and_sized_for_the_models() {
        let (mut a, mut b) = (VadStream::new(3), VadStream::new(3));
        assert_eq!(a.next_chunk(), b.next_chunk());
        assert_eq!(a.next_chunk().len(), VAD_CHUNK);
        assert_ne!(VadStream::new(4).next_chunk(), VadStream::new(3).next_chunk());
        let image = ocr_image(1, 64, 96);
        assert_eq!(image.len(), 3 * 64 * 96);
        assert!(image.iter().any(|&p| p < 0.0) && image.iter().any(|&p| p > 0.0));
        assert_eq!(image, ocr_image(1, 64, 96));
        let lines = ocr_lines(5, 2, 80);
        assert_eq!(lines.len(), 2 * 3 * OCR_LINE_HEIGHT * 80);
        assert!(lines.iter().any(|&p| p < 0.0) && lines.iter().any(|&p| p > 0.0));
        assert_eq!(lines, ocr_lines(5, 2, 80));
        let plane = 3 * OCR_LINE_HEIGHT * 80;
        assert_ne!(lines[..plane], lines[plane..], "each line of a batch differs");
        assert_ne!(ocr_lines(6, 1, 80), lines[..plane]);
    }

    /// Counts its calls and fails each: no session needed (the refusal comes before any
    /// tensor, so ONNX Runtime need not be loaded either).
    struct Unreachable(usize);

    impl Infer for Unreachable {
        fn infer<'s>(&'s mut self, _inputs: NamedInputs<'_>) -> Result<SessionOutputs<'s>, OrtAdapterError> {
            self.0 += 1;
            Err(OrtAdapterError::Runtime { action: "run", message: "no model here".to_owned() })
        }
    }

    #[test]
    fn a_vad_chunk_shorter_than_the_context_is_refused_before_the_model_runs() {
        let mut stream = VadStream::new(1);
        let mut session = Unreachable(0);
        let Err(OrtAdapterError::Runtime { message, .. }) = stream.step(&mut session, &[0.5; VAD_CONTEXT - 1]) else {
            panic!("a short chunk must be refused");
        };
        assert!(message.contains("63 samples") && message.contains("512 samples"), "{message}");
        assert_eq!(session.0, 0, "refused before the model runs");
        assert_eq!(stream.context, vec![0.0; VAD_CONTEXT], "the stream is unchanged");
    }
}
