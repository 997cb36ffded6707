//! A line chart written as a PNG, with no dependencies: a small RGB canvas, a 5x7 bitmap font,
//! and a PNG encoder using stored (uncompressed) deflate blocks.

/// An RGB colour.
pub type Rgb = [u8; 3];

const WHITE: Rgb = [255, 255, 255];
const BLACK: Rgb = [30, 30, 30];
const GRID: Rgb = [225, 225, 225];

/// One plotted series.
pub struct Series {
    pub name: String,
    pub color: Rgb,
    pub values: Vec<f64>,
}

struct Canvas {
    w: usize,
    h: usize,
    px: Vec<u8>,
}

impl Canvas {
    fn new(w: usize, h: usize) -> Canvas {
        Canvas {
            w,
            h,
            px: WHITE.repeat(w * h),
        }
    }

    fn set(&mut self, x: i64, y: i64, c: Rgb) {
        if x >= 0 && y >= 0 && (x as usize) < self.w && (y as usize) < self.h {
            let i = (y as usize * self.w + x as usize) * 3;
            self.px[i..i + 3].copy_from_slice(&c);
        }
    }

    fn rect(&mut self, x: i64, y: i64, w: i64, h: i64, c: Rgb) {
        for yy in y..y + h {
            for xx in x..x + w {
                self.set(xx, yy, c);
            }
        }
    }

    /// A line `thick` pixels wide (Bresenham, stamped with squares).
    fn line(&mut self, (mut x0, mut y0): (i64, i64), (x1, y1): (i64, i64), thick: i64, c: Rgb) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let mut err = dx + dy;
        loop {
            self.rect(x0 - thick / 2, y0 - thick / 2, thick, thick, c);
            if x0 == x1 && y0 == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x0 += sx;
            }
            if e2 <= dx {
                err += dx;
                y0 += sy;
            }
        }
    }

    /// Text at (x, y) (top left), each font pixel drawn `scale` x `scale`.
    fn text(&mut self, x: i64, y: i64, s: &str, scale: i64, c: Rgb) {
        for (i, ch) in s.chars().enumerate() {
            let rows = glyph(ch);
            for (r, bits) in rows.iter().enumerate() {
                for col in 0..5 {
                    if bits & (0x10 >> col) != 0 {
                        self.rect(
                            x + (i as i64 * 6 + col) * scale,
                            y + r as i64 * scale,
                            scale,
                            scale,
                            c,
                        );
                    }
                }
            }
        }
    }

    fn text_width(s: &str, scale: i64) -> i64 {
        s.chars().count() as i64 * 6 * scale
    }
}

/// 5x7 glyphs (bit 4 is the leftmost column); lower case is drawn as upper case.
fn glyph(c: char) -> [u8; 7] {
    match c.to_ascii_uppercase() {
        '0' => [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E],
        '1' => [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E],
        '2' => [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F],
        '3' => [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E],
        '4' => [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02],
        '5' => [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E],
        '6' => [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E],
        '7' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08],
        '8' => [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E],
        '9' => [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C],
        'A' => [0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'B' => [0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E],
        'C' => [0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E],
        'D' => [0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C],
        'E' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F],
        'F' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10],
        'G' => [0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F],
        'H' => [0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'I' => [0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E],
        'J' => [0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C],
        'K' => [0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11],
        'L' => [0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F],
        'M' => [0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11],
        'N' => [0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11],
        'O' => [0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'P' => [0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10],
        'Q' => [0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D],
        'R' => [0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11],
        'S' => [0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E],
        'T' => [0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04],
        'U' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'V' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04],
        'W' => [0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A],
        'X' => [0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11],
        'Y' => [0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04],
        'Z' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F],
        '.' => [0, 0, 0, 0, 0, 0x0C, 0x0C],
        ',' => [0, 0, 0, 0, 0x0C, 0x04, 0x08],
        '/' => [0x01, 0x01, 0x02, 0x04, 0x08, 0x10, 0x10],
        '-' => [0, 0, 0, 0x1F, 0, 0, 0],
        '=' => [0, 0, 0x1F, 0, 0x1F, 0, 0],
        ':' => [0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0],
        '(' => [0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02],
        ')' => [0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08],
        _ => [0; 7],
    }
}

/// Draws series against categorical x labels and returns the PNG bytes.
// Long: draws the axes, grid, series and legend of one chart in plotting order on one drawing area.
pub fn line_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    xs: &[String],
    series: &[Series],
) -> Vec<u8> {
    let (w, h) = (960usize, 560usize);
    let (left, right, top, bottom) = (110i64, 40i64, 70i64, 100i64);
    let mut c = Canvas::new(w, h);
    let (pw, ph) = (w as i64 - left - right, h as i64 - top - bottom);
    let max = series
        .iter()
        .flat_map(|s| s.values.iter().copied())
        .fold(0.0f64, f64::max)
        .max(1e-9)
        * 1.15;
    // Grid and y ticks.
    for i in 0..=5 {
        let y = top + ph - ph * i / 5;
        c.line((left, y), (left + pw, y), 1, GRID);
        let v = max * i as f64 / 5.0;
        let label = if max >= 10.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.2}")
        };
        c.text(
            left - 12 - Canvas::text_width(&label, 2),
            y - 7,
            &label,
            2,
            BLACK,
        );
    }
    // Axes.
    c.line((left, top), (left, top + ph), 2, BLACK);
    c.line((left, top + ph), (left + pw, top + ph), 2, BLACK);
    let n = xs.len().max(1) as i64;
    let xpos = |i: usize| left + pw * (2 * i as i64 + 1) / (2 * n);
    for (i, label) in xs.iter().enumerate() {
        let x = xpos(i);
        c.line((x, top + ph), (x, top + ph + 6), 2, BLACK);
        c.text(
            x - Canvas::text_width(label, 2) / 2,
            top + ph + 14,
            label,
            2,
            BLACK,
        );
    }
    for s in series {
        let pts: Vec<(i64, i64)> = s
            .values
            .iter()
            .enumerate()
            .map(|(i, v)| (xpos(i), top + ph - (ph as f64 * v / max) as i64))
            .collect();
        for pair in pts.windows(2) {
            c.line(pair[0], pair[1], 3, s.color);
        }
        for p in &pts {
            c.rect(p.0 - 5, p.1 - 5, 10, 10, s.color);
        }
    }
    c.text(
        (w as i64 - Canvas::text_width(title, 3)) / 2,
        18,
        title,
        3,
        BLACK,
    );
    c.text(
        left + (pw - Canvas::text_width(x_label, 2)) / 2,
        h as i64 - 40,
        x_label,
        2,
        BLACK,
    );
    c.text(12, top - 30, y_label, 2, BLACK);
    // Legend.
    let mut ly = top + 8;
    for s in series {
        let lx = left + pw - 12 - Canvas::text_width(&s.name, 2) - 30;
        c.rect(lx, ly + 2, 20, 10, s.color);
        c.text(lx + 28, ly, &s.name, 2, BLACK);
        ly += 24;
    }
    encode_png(w, h, &c.px)
}

fn crc32(data: &[&[u8]]) -> u32 {
    let mut table = [0u32; 256];
    for (i, t) in table.iter_mut().enumerate() {
        let mut c = i as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
        *t = c;
    }
    let mut c = 0xFFFF_FFFFu32;
    for part in data {
        for &b in *part {
            c = table[((c ^ u32::from(b)) & 0xFF) as usize] ^ (c >> 8);
        }
    }
    !c
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    out.extend_from_slice(&crc32(&[kind, data]).to_be_bytes());
}

/// Encodes 8-bit RGB pixels as a PNG (zlib stream of stored deflate blocks).
pub fn encode_png(w: usize, h: usize, rgb: &[u8]) -> Vec<u8> {
    let mut raw = Vec::with_capacity(h * (w * 3 + 1));
    for row in rgb.chunks(w * 3) {
        raw.push(0); // filter: none
        raw.extend_from_slice(row);
    }
    let mut z = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = raw.chunks(65_535).collect();
    for (i, b) in blocks.iter().enumerate() {
        z.push(u8::from(i + 1 == blocks.len()));
        z.extend_from_slice(&(b.len() as u16).to_le_bytes());
        z.extend_from_slice(&(!(b.len() as u16)).to_le_bytes());
        z.extend_from_slice(b);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &x in &raw {
        a = (a + u32::from(x)) % 65_521;
        b = (b + a) % 65_521;
    }
    z.extend_from_slice(&((b << 16) | a).to_be_bytes());
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&(w as u32).to_be_bytes());
    ihdr.extend_from_slice(&(h as u32).to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    let mut out = vec![0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A];
    chunk(&mut out, b"IHDR", &ihdr);
    chunk(&mut out, b"IDAT", &z);
    chunk(&mut out, b"IEND", &[]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn png_structure_and_checksums() {
        let png = encode_png(2, 1, &[255, 0, 0, 0, 255, 0]);
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        // CRC of an empty IEND chunk is a well-known constant.
        assert_eq!(&png[png.len() - 4..], &[0xAE, 0x42, 0x60, 0x82]);
        let chart = line_chart(
            "T",
            "X",
            "Y",
            &["1".into(), "2".into()],
            &[Series {
                name: "KVLINK".into(),
                color: [0, 0, 200],
                values: vec![1.0, 2.0],
            }],
        );
        assert!(chart.len() > 960 * 560 * 3);
    }
}
