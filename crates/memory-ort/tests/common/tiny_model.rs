//! A tiny ONNX model written as protobuf bytes here, so the fast tests need no model
//! file: `Y = Relu(X · W + B)` with `X: [batch, 64]` (batch symbolic), `W: [64, 64]` and
//! `B: [64]` as initializers (so ONNX Runtime reserves them) and activations that grow
//! with the batch.

pub const FEATURES: usize = 64;

/// The model's bytes (ONNX IR 8, opset 13).
pub fn bytes() -> Vec<u8> {
    let weights: Vec<f32> = (0..FEATURES * FEATURES).map(|i| ((i * 7919) % 97) as f32 / 97.0 - 0.5).collect();
    let bias: Vec<f32> = (0..FEATURES).map(|i| (i as f32) / 64.0 - 0.5).collect();
    let mut graph = Vec::new();
    field_bytes(&mut graph, 1, &node(&["X", "W"], "XW", "MatMul"));
    field_bytes(&mut graph, 1, &node(&["XW", "B"], "Z", "Add"));
    field_bytes(&mut graph, 1, &node(&["Z"], "Y", "Relu"));
    field_bytes(&mut graph, 2, b"tiny");
    field_bytes(&mut graph, 5, &tensor("W", &[FEATURES as i64, FEATURES as i64], &weights));
    field_bytes(&mut graph, 5, &tensor("B", &[FEATURES as i64], &bias));
    field_bytes(&mut graph, 11, &value_info("X"));
    field_bytes(&mut graph, 12, &value_info("Y"));

    let mut opset = Vec::new();
    field_bytes(&mut opset, 1, b"");
    field_varint(&mut opset, 2, 13);

    let mut model = Vec::new();
    field_varint(&mut model, 1, 8); // ir_version
    field_bytes(&mut model, 2, b"memory-ort tests"); // producer_name
    field_bytes(&mut model, 7, &graph);
    field_bytes(&mut model, 8, &opset);
    model
}

/// What the model computes, for checking outputs.
pub fn reference(input: &[f32]) -> Vec<f32> {
    let weights: Vec<f32> = (0..FEATURES * FEATURES).map(|i| ((i * 7919) % 97) as f32 / 97.0 - 0.5).collect();
    let bias: Vec<f32> = (0..FEATURES).map(|i| (i as f32) / 64.0 - 0.5).collect();
    input
        .chunks(FEATURES)
        .flat_map(|row| {
            (0..FEATURES)
                .map(|j| {
                    let sum: f32 = (0..FEATURES).map(|k| row[k] * weights[k * FEATURES + j]).sum();
                    (sum + bias[j]).max(0.0)
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

fn node(inputs: &[&str], output: &str, op: &str) -> Vec<u8> {
    let mut node = Vec::new();
    for input in inputs {
        field_bytes(&mut node, 1, input.as_bytes());
    }
    field_bytes(&mut node, 2, output.as_bytes());
    field_bytes(&mut node, 3, format!("{op}_{output}").as_bytes());
    field_bytes(&mut node, 4, op.as_bytes());
    node
}

fn tensor(name: &str, dims: &[i64], values: &[f32]) -> Vec<u8> {
    let mut tensor = Vec::new();
    for &dim in dims {
        field_varint(&mut tensor, 1, dim as u64);
    }
    field_varint(&mut tensor, 2, 1); // FLOAT
    field_bytes(&mut tensor, 8, name.as_bytes());
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    field_bytes(&mut tensor, 9, &raw);
    tensor
}

/// A float tensor `[batch, FEATURES]`.
fn value_info(name: &str) -> Vec<u8> {
    let mut batch = Vec::new();
    field_bytes(&mut batch, 2, b"batch"); // dim_param
    let mut features = Vec::new();
    field_varint(&mut features, 1, FEATURES as u64); // dim_value
    let mut shape = Vec::new();
    field_bytes(&mut shape, 1, &batch);
    field_bytes(&mut shape, 1, &features);
    let mut tensor_type = Vec::new();
    field_varint(&mut tensor_type, 1, 1); // elem_type FLOAT
    field_bytes(&mut tensor_type, 2, &shape);
    let mut type_proto = Vec::new();
    field_bytes(&mut type_proto, 1, &tensor_type);
    let mut info = Vec::new();
    field_bytes(&mut info, 1, name.as_bytes());
    field_bytes(&mut info, 2, &type_proto);
    info
}

fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn field_varint(out: &mut Vec<u8>, field: u64, value: u64) {
    varint(out, field << 3);
    varint(out, value);
}

fn field_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}
