//! A markdown table whose columns are padded to line up in a terminal too.

/// Column alignment.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Align {
    /// Text.
    Left,
    /// Numbers.
    Right,
}

/// Renders `rows` under `headers` as a GitHub-flavoured markdown table. `|` inside a
/// cell is escaped; rows shorter than the header are padded with empty cells.
pub(crate) fn markdown(headers: &[(&str, Align)], rows: &[Vec<String>]) -> String {
    let escape = |cell: &str| cell.replace('|', "\\|");
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|row| (0..headers.len()).map(|i| row.get(i).map_or_else(String::new, |cell| escape(cell))).collect())
        .collect();
    let widths: Vec<usize> = headers
        .iter()
        .enumerate()
        .map(|(i, (header, _))| {
            cells.iter().map(|row| row[i].chars().count()).chain([header.chars().count(), 3]).max().unwrap_or(3)
        })
        .collect();
    let pad = |text: &str, width: usize, align: Align| {
        let fill = " ".repeat(width.saturating_sub(text.chars().count()));
        match align {
            Align::Left => format!("{text}{fill}"),
            Align::Right => format!("{fill}{text}"),
        }
    };
    let mut out = String::new();
    let line = |parts: Vec<String>| format!("| {} |\n", parts.join(" | "));
    out.push_str(&line(
        headers.iter().zip(&widths).map(|((header, _), &width)| pad(header, width, Align::Left)).collect(),
    ));
    out.push_str(&line(
        headers
            .iter()
            .zip(&widths)
            .map(|((_, align), &width)| match align {
                Align::Left => "-".repeat(width),
                Align::Right => format!("{}:", "-".repeat(width - 1)),
            })
            .collect(),
    ));
    for row in &cells {
        out.push_str(&line(
            row.iter().zip(headers).zip(&widths).map(|((cell, (_, align)), &width)| pad(cell, width, *align)).collect(),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_line_up_and_numbers_align_right() {
        let table = markdown(
            &[("bench", Align::Left), ("median", Align::Right)],
            &[vec!["pair/bound".into(), "30.1 ns".into()], vec!["bind".into(), "9.0 ns".into()]],
        );
        assert_eq!(
            table,
            "| bench      | median  |\n\
             | ---------- | ------: |\n\
             | pair/bound | 30.1 ns |\n\
             | bind       |  9.0 ns |\n"
        );
    }

    #[test]
    fn pipes_are_escaped_and_short_rows_padded() {
        let table = markdown(&[("a", Align::Left), ("b", Align::Left)], &[vec!["x|y".into()]]);
        assert!(table.contains("| x\\|y |     |"), "{table}");
    }
}
