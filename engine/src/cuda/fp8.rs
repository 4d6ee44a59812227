//! FP8 e4m3 on the host: what `kernels/fp8.cu` computes, element for element, as the reference
//! its tests and the FP8 products' tests check the device against.
//!
//! e4m3 (the "fn" variant Hopper's tensor cores take): a sign, 4 exponent bits of bias 7 and 3
//! mantissa bits; no infinities, `S.1111.111` is NaN, so the largest finite magnitude is 448.
//! Exponent field 0 holds the subnormals, multiples of 2⁻⁹ below 2⁻⁶.

/// e4m3's largest finite magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// `x` rounded to the nearest e4m3 value (ties to even), saturating at ±448; NaN stays NaN.
/// As PTX's `cvt.rn.satfinite.e4m3x2.f32`.
pub fn e4m3_from_f32(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    if x.is_nan() {
        return 0x7f | sign;
    }
    let a = f64::from(x.abs());
    // Everything from 448 up (infinity too) saturates: 448 is the largest finite value, and
    // whatever rounds past it would be the NaN code.
    if a >= f64::from(E4M3_MAX) {
        return 0x7e | sign;
    }
    let min_normal = 2f64.powi(-6);
    let code = if a < min_normal {
        // Subnormal: a multiple of 2⁻⁹; 8 of them rounds up to the smallest normal (code 8).
        (a * 512.0).round_ties_even() as u8
    } else {
        let mut exp = a.log2().floor() as i32;
        // `log2` may land a hair off an exact power of two: put the exponent where
        // 2^exp <= a < 2^(exp+1) holds exactly.
        if 2f64.powi(exp) > a {
            exp -= 1;
        } else if 2f64.powi(exp + 1) <= a {
            exp += 1;
        }
        let mut mant = (a / 2f64.powi(exp - 3)).round_ties_even() as i32;
        if mant == 16 {
            exp += 1;
            mant = 8;
        }
        (((exp + 7) << 3) | (mant - 8)) as u8
    };
    code | sign
}

/// The value of an e4m3 code.
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, mant) = (i32::from((code >> 3) & 0xf), f32::from(code & 7));
    if exp == 15 && mant == 7.0 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        mant * 2f32.powi(-9)
    } else {
        (1.0 + mant / 8.0) * 2f32.powi(exp - 7)
    };
    sign * magnitude
}

/// One row as the device quantizes it: the scale (the largest magnitude over 448, or 1 for a
/// row of zeros) and each element times the scale's reciprocal, rounded to e4m3. The
/// arithmetic is f32, as the kernel's.
pub fn quantize_row(row: &[f32]) -> (Vec<u8>, f32) {
    let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = if max > 0.0 { max / E4M3_MAX } else { 1.0 };
    let inv = 1.0 / scale;
    (row.iter().map(|&v| e4m3_from_f32(v * inv)).collect(), scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_decodes_and_encodes_back() {
        for code in 0..=255u8 {
            let v = e4m3_to_f32(code);
            if v.is_nan() {
                assert_eq!(code & 0x7f, 0x7f, "code {code:#x}");
                continue;
            }
            // Negative zero encodes with its sign.
            assert_eq!(e4m3_from_f32(v), code, "code {code:#x} = {v}");
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    }

    #[test]
    fn rounding_is_to_nearest_even_and_saturates() {
        // Between 1 (0x38) and 1.125 (0x39): the tie goes to the even mantissa.
        assert_eq!(e4m3_from_f32(1.0625), 0x38);
        assert_eq!(e4m3_from_f32(1.0626), 0x39);
        // Between 1.125 and 1.25 (0x3a): the tie goes up to the even one.
        assert_eq!(e4m3_from_f32(1.1875), 0x3a);
        // 15.5 rounds up across the exponent: 16 (0x58).
        assert_eq!(e4m3_from_f32(15.5), 0x58);
        // Saturation, where plain rounding would reach 480 (the NaN code).
        assert_eq!(e4m3_from_f32(470.0), 0x7e);
        assert_eq!(e4m3_from_f32(1e9), 0x7e);
        assert_eq!(e4m3_from_f32(-1e9), 0xfe);
        assert_eq!(e4m3_from_f32(f32::INFINITY), 0x7e);
        // Subnormals and their ties; below half the smallest, zero.
        assert_eq!(e4m3_from_f32(1.5 * 2f32.powi(-9)), 0x02);
        assert_eq!(e4m3_from_f32(2.5 * 2f32.powi(-9)), 0x02);
        assert_eq!(e4m3_from_f32(0.4 * 2f32.powi(-9)), 0x00);
        assert_eq!(e4m3_from_f32(-0.4 * 2f32.powi(-9)), 0x80);
        assert!(e4m3_to_f32(e4m3_from_f32(f32::NAN)).is_nan());
    }

    #[test]
    fn a_rows_largest_element_becomes_448() {
        let (q, scale) = quantize_row(&[0.5, -2.0, 1.0, 0.0]);
        assert_eq!(scale, 2.0 / 448.0);
        assert_eq!(e4m3_to_f32(q[1]), -448.0);
        assert_eq!(e4m3_to_f32(q[3]), 0.0);
        for (&v, &c) in [0.5f32, -2.0, 1.0].iter().zip(&q) {
            let back = e4m3_to_f32(c) * scale;
            assert!(
                (back - v).abs() <= v.abs() / 16.0,
                "{v} came back as {back}"
            );
        }
        assert_eq!(quantize_row(&[0.0; 8]), (vec![0; 8], 1.0));
    }
}
