//! Line charts as SVG, for the benchmarks' figures in docs/bench: categories evenly spaced on the
//! x axis, a y axis from 0 with round ticks, every series named in a legend that wraps.
use std::fmt::Write as _;

/// One line of a chart.
pub struct Series {
    pub name: String,
    /// One a category; NaN where there is no point.
    pub values: Vec<f64>,
    /// An index into the palette: series of one colour belong together.
    pub colour: usize,
    /// Drawn dashed, without points: a reference line (a ceiling).
    pub dashed: bool,
}

const W: f64 = 640.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const PLOT: f64 = 230.0;
/// Below the plot: the categories and the axis name, then the legend.
const AXIS: f64 = 60.0;
const LEGEND_ROW: f64 = 20.0;
const LEGEND_WIDTH: f64 = 200.0;
const COLOURS: [&str; 7] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#555555",
];

/// The top of the y axis and its step: round numbers (1, 2, 2.5 or 5 times a power of ten),
/// at most 6 steps, the axis reaching at least `max`.
pub fn ticks(max: f64) -> (f64, f64) {
    let max = if max > 0.0 { max } else { 1.0 };
    let magnitude = 10f64.powf((max / 6.0).log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|step| (max / step).ceil() <= 6.0)
        .unwrap_or(10.0 * magnitude);
    ((max / step).ceil() * step, step)
}

pub fn line_chart(title: &str, unit: &str, labels: &[String], series: &[Series]) -> String {
    let per_row = ((W - LEFT - RIGHT) / LEGEND_WIDTH).floor().max(1.0) as usize;
    let rows = series.len().div_ceil(per_row);
    let h = TOP + PLOT + AXIS + LEGEND_ROW * rows as f64 + 10.0;
    let data_max = (series.iter())
        .flat_map(|s| s.values.iter().copied())
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    let (top, step) = ticks(data_max);
    let x = |i: usize| {
        let span = (labels.len().max(2) - 1) as f64;
        LEFT + (W - LEFT - RIGHT) * i as f64 / span
    };
    let y = |v: f64| TOP + PLOT * (1.0 - v / top);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">{title}</text>\n",
        W / 2.0
    );
    let mut v = 0.0;
    while v <= top + step / 2.0 {
        let _ = writeln!(
            svg,
            "<line x1=\"{LEFT}\" x2=\"{}\" y1=\"{y0:.1}\" y2=\"{y0:.1}\" stroke=\"#dddddd\"/>\
             <text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            W - RIGHT,
            LEFT - 6.0,
            y(v) + 4.0,
            number(v, step),
            y0 = y(v),
        );
        v += step;
    }
    let below = TOP + PLOT;
    for (i, label) in labels.iter().enumerate() {
        let _ = writeln!(
            svg,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{label}</text>",
            x(i),
            below + 18.0
        );
    }
    let middle = TOP + PLOT / 2.0;
    let _ = writeln!(
        svg,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">Services</text>\
         <text x=\"16\" y=\"{middle}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {middle})\">{unit}</text>",
        (LEFT + W - RIGHT) / 2.0,
        below + 36.0,
    );
    for (k, s) in series.iter().enumerate() {
        let colour = COLOURS[s.colour % COLOURS.len()];
        let dash = if s.dashed {
            " stroke-dasharray=\"6 4\""
        } else {
            ""
        };
        let points: Vec<(f64, f64)> = (s.values.iter().enumerate())
            .filter(|(_, v)| v.is_finite())
            .map(|(i, v)| (x(i), y(*v)))
            .collect();
        let line: Vec<String> = points
            .iter()
            .map(|(px, py)| format!("{px:.1},{py:.1}"))
            .collect();
        let _ = writeln!(
            svg,
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\"{dash} points=\"{}\"/>",
            line.join(" ")
        );
        if !s.dashed {
            for (px, py) in &points {
                let _ = writeln!(
                    svg,
                    "<circle cx=\"{px:.1}\" cy=\"{py:.1}\" r=\"3\" fill=\"{colour}\"/>"
                );
            }
        }
        let ly = below + AXIS + LEGEND_ROW * (k / per_row) as f64;
        let lx = LEFT + LEGEND_WIDTH * (k % per_row) as f64;
        let _ = writeln!(
            svg,
            "<line x1=\"{lx}\" x2=\"{}\" y1=\"{ly}\" y2=\"{ly}\" stroke=\"{colour}\" stroke-width=\"2\"{dash}/>\
             <text x=\"{}\" y=\"{}\">{}</text>",
            lx + 24.0,
            lx + 30.0,
            ly + 4.0,
            s.name
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// A tick's label: as many decimals as the step has.
fn number(v: f64, step: f64) -> String {
    let step = format!("{step:.3}");
    let decimals = (step.trim_end_matches('0').split_once('.')).map_or(0, |(_, d)| d.len());
    format!("{v:.decimals$}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_ticks() {
        let near =
            |(a, b): (f64, f64), (c, d): (f64, f64)| (a - c).abs() < 1e-9 && (b - d).abs() < 1e-9;
        assert!(near(ticks(12609.0), (15000.0, 2500.0)));
        assert!(near(ticks(20.37), (25.0, 5.0)));
        assert!(near(ticks(1.42), (1.5, 0.25)));
        assert!(near(ticks(0.0), (1.0, 0.2)));
        assert_eq!(number(0.25, 0.25), "0.25");
        assert_eq!(number(1.5, 0.25), "1.50");
        assert_eq!(number(15000.0, 2500.0), "15000");
    }

    /// Every point inside the plot, every legend entry inside the picture.
    #[test]
    fn everything_is_drawn_inside() {
        let labels: Vec<String> = ["1", "1000", "30000"].map(String::from).to_vec();
        let series: Vec<Series> = (0..8)
            .map(|k| Series {
                name: format!("series {k}"),
                values: vec![0.0, 50.0 * f64::from(k), f64::NAN],
                colour: k as usize / 2,
                dashed: k % 2 == 1,
            })
            .collect();
        let svg = line_chart("t", "u", &labels, &series);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), 8);
        assert_eq!(
            svg.matches("stroke-dasharray").count(),
            8,
            "4 dashed, each in the legend too"
        );
        let height: f64 = attr(svg.lines().next().unwrap(), "height");
        for line in svg.lines() {
            if line.starts_with("<circle") {
                assert!((LEFT..=W - RIGHT).contains(&attr(line, "cx")), "{line}");
                assert!((TOP..=TOP + PLOT).contains(&attr(line, "cy")), "{line}");
            }
            if let Some(at) = line.find("<text x=\"") {
                let text = &line[at..];
                assert!((0.0..W).contains(&attr(text, "x")), "{line}");
                assert!((0.0..height).contains(&attr(text, "y")), "{line}");
            }
        }
        for k in 0..8 {
            assert!(svg.contains(&format!(">series {k}</text>")));
        }
    }

    fn attr(element: &str, name: &str) -> f64 {
        let at = element.find(&format!(" {name}=\"")).unwrap() + name.len() + 3;
        element[at..].split('"').next().unwrap().parse().unwrap()
    }
}
