//! Table: the benchmark's output, printed as it goes and written as JSON lines.

#[derive(Default)]
pub struct Table {
    rows: Vec<[String; 4]>,
    /// Every row as a JSON object, with its numbers, so that two runs can be compared.
    json: Vec<serde_json::Value>,
}

impl Table {
    pub fn row(&mut self, scenario: &str, subject: &str, result: String, note: String) {
        self.row_with(scenario, subject, result, note, serde_json::json!({}));
    }

    /// A row and, in its JSON object, the figures behind it.
    pub fn row_with(
        &mut self,
        scenario: &str,
        subject: &str,
        result: String,
        note: String,
        figures: serde_json::Value,
    ) {
        println!("  {scenario} | {subject} | {result} | {note}");
        self.json.push(serde_json::json!({
            "scenario": scenario, "subject": subject, "result": result, "note": note, "figures": figures,
        }));
        self.rows.push([scenario.into(), subject.into(), result, note]);
    }

    /// Writes one JSON object per row to `path`.
    pub fn write_json(&self, path: &std::path::Path) -> anyhow::Result<()> {
        let lines: Vec<String> = self.json.iter().map(|row| row.to_string()).collect();
        std::fs::write(path, lines.join("\n") + "\n")?;
        Ok(())
    }

    pub fn render(&self) -> String {
        let header = ["scenario", "subject", "result", "note"];
        let widths: Vec<usize> =
            (0..4).map(|i| self.rows.iter().map(|r| r[i].len()).chain([header[i].len()]).max().unwrap_or(0)).collect();
        let line = |cells: [&str; 4]| {
            cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect::<Vec<_>>().join(" | ")
        };
        let mut out = vec![line(header), widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>().join("-|-")];
        for r in &self.rows {
            out.push(line([&r[0], &r[1], &r[2], &r[3]]));
        }
        out.join("\n")
    }
}
