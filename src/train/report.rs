//! The loss curve a person looks at: `OUTPUT/loss.svg`, rewritten (atomically) as training goes,
//! with the training loss per step, the evaluation loss where it was measured, and (GRPO) the
//! mean reward per step on its own scale (the right-hand axis).

use std::path::Path;

use anyhow::Result;

/// Points (step, value) of the two curves.
#[derive(Debug, Default, Clone)]
pub struct LossHistory {
    pub train: Vec<(usize, f64)>,
    pub eval: Vec<(usize, f64)>,
    /// GRPO's mean reward per step (empty otherwise).
    pub reward: Vec<(usize, f64)>,
}

fn fmt(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

impl LossHistory {
    pub fn to_svg(&self) -> String {
        let (w, h, left, right, top, bottom) = (720.0, 360.0, 60.0, 20.0, 30.0, 40.0);
        let all: Vec<&(usize, f64)> = self.train.iter().chain(&self.eval).filter(|(_, v)| v.is_finite()).collect();
        let steps: Vec<usize> = all.iter().map(|(s, _)| *s).chain(self.reward.iter().map(|(s, _)| *s)).collect();
        let max_step = steps.iter().copied().max().unwrap_or(1).max(1) as f64;
        let min_step = steps.iter().copied().min().unwrap_or(0) as f64;
        let hi = all.iter().map(|(_, v)| *v).fold(f64::MIN, f64::max);
        let lo = all.iter().map(|(_, v)| *v).fold(f64::MAX, f64::min).min(hi);
        let (lo, hi) = if all.is_empty() {
            (0.0, 1.0)
        } else if hi - lo < 1e-9 {
            (lo - 0.5, hi + 0.5)
        } else {
            (lo, hi)
        };
        let x = |s: f64| left + (s - min_step) / (max_step - min_step).max(1.0) * (w - left - right);
        let y = |v: f64| top + (hi - v) / (hi - lo) * (h - top - bottom);
        let path = |pts: &[(usize, f64)]| {
            pts.iter()
                .filter(|(_, v)| v.is_finite())
                .map(|(s, v)| format!("{:.1},{:.1}", x(*s as f64), y(*v)))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let title = match self.reward.is_empty() {
            true => "loss by step (train: blue line, eval: orange dots)",
            false => "loss (blue, left axis) and mean reward (green, right axis) by step",
        };
        let mut svg = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
             <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
             <text x=\"{left}\" y=\"18\" font-size=\"14\">{title}</text>\n\
             <line x1=\"{left}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#444\"/>\n<line x1=\"{left}\" y1=\"{top}\" x2=\"{left}\" y2=\"{}\" stroke=\"#444\"/>\n",
            h - bottom,
            w - right,
            h - bottom,
            h - bottom
        );
        for i in 0..=4 {
            let v = lo + (hi - lo) * i as f64 / 4.0;
            svg += &format!("<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n", left - 6.0, y(v) + 4.0, fmt(v));
        }
        svg += &format!("<text x=\"{left}\" y=\"{}\">step {}</text>\n", h - 12.0, min_step as usize);
        svg += &format!("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">step {}</text>\n", w - right, h - 12.0, max_step as usize);
        if !self.train.is_empty() {
            svg += &format!("<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"2\" points=\"{}\"/>\n", path(&self.train));
        }
        for (s, v) in self.eval.iter().filter(|(_, v)| v.is_finite()) {
            svg += &format!(
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"4\" fill=\"#ff7f0e\"><title>eval loss {v:.4} at step {s}</title></circle>\n",
                x(*s as f64),
                y(*v)
            );
        }
        let rewards: Vec<&(usize, f64)> = self.reward.iter().filter(|(_, v)| v.is_finite()).collect();
        if !rewards.is_empty() {
            let r_hi = rewards.iter().map(|(_, v)| *v).fold(f64::MIN, f64::max);
            let r_lo = rewards.iter().map(|(_, v)| *v).fold(f64::MAX, f64::min);
            let (r_lo, r_hi) = if r_hi - r_lo < 1e-9 { (r_lo - 0.5, r_hi + 0.5) } else { (r_lo, r_hi) };
            let ry = |v: f64| top + (r_hi - v) / (r_hi - r_lo) * (h - top - bottom);
            let points: Vec<String> = rewards.iter().map(|(s, v)| format!("{:.1},{:.1}", x(*s as f64), ry(*v))).collect();
            svg += &format!("<polyline fill=\"none\" stroke=\"#2ca02c\" stroke-width=\"2\" points=\"{}\"/>\n", points.join(" "));
            for v in [r_lo, r_hi] {
                svg +=
                    &format!("<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\" fill=\"#2ca02c\">{}</text>\n", w - 2.0, ry(v) + 4.0, fmt(v));
            }
        }
        svg += "</svg>\n";
        svg
    }

    /// Rewrites `path` (temporary name, then rename).
    pub fn write_svg(&self, path: &Path) -> Result<()> {
        let tmp = path.with_extension("svg.tmp");
        std::fs::write(&tmp, self.to_svg())?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_has_both_curves_scaled_into_the_frame() {
        let h = LossHistory { train: vec![(1, 4.0), (2, 3.0), (3, 2.0)], eval: vec![(3, 2.5)], reward: vec![] };
        let svg = h.to_svg();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("<polyline") && svg.contains("points=\"60.0,30.0 "), "{svg}");
        assert!(svg.contains("eval loss 2.5000 at step 3"));
        // Empty and flat histories still render.
        assert!(LossHistory::default().to_svg().contains("</svg>"));
        assert!(LossHistory { train: vec![(1, 1.0), (2, 1.0)], eval: vec![], reward: vec![] }.to_svg().contains("<polyline"));
        // GRPO's reward, on its own axis.
        let grpo = LossHistory { train: vec![(1, 0.1), (2, 0.0)], eval: vec![], reward: vec![(1, 0.25), (2, 0.75)] }.to_svg();
        assert!(grpo.contains("stroke=\"#2ca02c\"") && grpo.contains("mean reward"), "{grpo}");
    }
}
