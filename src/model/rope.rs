//! The RoPE angle table both backends share (docs/numerics.md §5).
//!
//! Row `p` holds `cos(p·θ^(−2i/r))` for `i < r/2` followed by the matching sines, `r` the rotary
//! dimension. Angles are computed in f64 with our own `exp`/`log`/`sin`/`cos`
//! ([`crate::numerics`]) and rounded once to f32, so the table is the same bits on every
//! machine; a device backend uploads these rows rather than computing its own.

use crate::numerics::{exp_f64, log_f64, sin_cos_f64};

/// cos/sin rows for positions `0..len()`, grown on demand.
#[derive(Clone, Debug)]
pub struct RopeTable {
    rotary_dim: usize,
    inv_freq: Vec<f64>,
    rows: Vec<f32>,
}

impl RopeTable {
    /// An empty table for `rotary_dim` rotated dimensions and base `theta`.
    pub fn new(rotary_dim: usize, theta: f64) -> Self {
        let half = rotary_dim / 2;
        let ln_theta = log_f64(theta);
        let inv_freq = (0..half).map(|i| exp_f64(-((2 * i) as f64 / rotary_dim as f64) * ln_theta)).collect();
        Self { rotary_dim, inv_freq, rows: Vec::new() }
    }

    /// Positions the table covers.
    pub fn len(&self) -> usize {
        self.rows.len() / self.rotary_dim.max(1)
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Makes rows `0..n` available.
    pub fn ensure(&mut self, n: usize) {
        let half = self.rotary_dim / 2;
        for p in self.len()..n {
            let mut cos = Vec::with_capacity(half);
            let mut sin = Vec::with_capacity(half);
            for &f in &self.inv_freq {
                let (s, c) = sin_cos_f64(p as f64 * f);
                cos.push(c as f32);
                sin.push(s as f32);
            }
            self.rows.extend_from_slice(&cos);
            self.rows.extend_from_slice(&sin);
        }
    }

    /// `(cos, sin)` of position `p`, each `rotary_dim / 2` long.
    ///
    /// # Panics
    /// If `p` is not covered (callers [`ensure`](Self::ensure) first).
    pub fn row(&self, p: usize) -> (&[f32], &[f32]) {
        let r = &self.rows[p * self.rotary_dim..(p + 1) * self.rotary_dim];
        r.split_at(self.rotary_dim / 2)
    }

    /// Rows `0..len()` as one slice (`[len, rotary_dim]`), for upload to a device.
    pub fn as_slice(&self) -> &[f32] {
        &self.rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn angles_match_f64_libm_to_rounding() {
        let mut t = RopeTable::new(64, 1e7);
        t.ensure(5000);
        for p in [0usize, 1, 17, 4095, 4999] {
            let (c, s) = t.row(p);
            for i in 0..32 {
                let ang = p as f64 * (1e7f64).powf(-(2.0 * i as f64) / 64.0);
                assert!((c[i] as f64 - ang.cos()).abs() <= 6e-8, "cos p={p} i={i}");
                assert!((s[i] as f64 - ang.sin()).abs() <= 6e-8, "sin p={p} i={i}");
            }
        }
        let (c0, s0) = t.row(0);
        assert!(c0.iter().all(|&x| x == 1.0) && s0.iter().all(|&x| x == 0.0));
    }
}
