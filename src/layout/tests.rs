//! Tests of `crate::layout`.

use super::*;
use crate::tp::TpRank;

fn region(len: u64) -> Vec<RegionInfo> {
    vec![RegionInfo {
        id: RegionId(0),
        len,
    }]
}

#[test]
fn presets_validate_and_size() {
    let s = ModelShape::LLAMA3_8B;
    assert_eq!(s.block_bytes(), 32 * 1024);
    let l = s.layout(RegionId(0), 100);
    assert_eq!(l.tensors.len(), 64);
    l.validate(&region(s.region_bytes(100))).unwrap();
    assert!(l.validate(&region(s.region_bytes(100) - 1)).is_err());
    let m = ModelShape::DEEPSEEK_V3_MLA;
    assert_eq!(m.block_bytes(), 9216);
    assert_eq!(m.layout(RegionId(0), 10).tensors.len(), 61);
}

#[test]
fn block_sizes_that_divide_pair_token_by_token() {
    let solo = TpRank::new(0, 1);
    let shape = |tokens| ModelShape {
        tokens_per_block: tokens,
        ..ModelShape::LLAMA3_8B
    };
    for head_major in [false, true] {
        let a = shape(16)
            .layout_tp(RegionId(0), 4, solo, head_major)
            .unwrap();
        let b = shape(64)
            .layout_tp(RegionId(1), 4, solo, head_major)
            .unwrap();
        assert!(a.differences(&b).is_empty(), "{:?}", a.differences(&b));
        let s = b.tensors[0].token_shape(64).unwrap();
        assert_eq!(
            (s.parts, s.head_major, s.heads, s.head_bytes),
            (1, head_major, 8, 256)
        );
    }
    // Head-major against token-major, and a tensor that does not say how it holds tokens.
    let a = shape(16).layout_tp(RegionId(0), 4, solo, true).unwrap();
    let mut b = shape(64).layout_tp(RegionId(1), 4, solo, false).unwrap();
    let d = a.differences(&b).join("; ");
    assert!(d.contains("head-major vs"), "{d}");
    b.tensors[0].token_runs = None;
    let d = b.differences(&a).join("; ");
    assert!(d.contains("declares no token runs"), "{d}");
    // Runs that do not fit the block are refused at registration.
    let mut c = shape(16).layout(RegionId(0), 4);
    c.tensors[1].token_runs = Some(3);
    let e = c.validate(&region(1 << 30)).unwrap_err().to_string();
    assert!(e.contains("not 3 token runs"), "{e}");
}

#[test]
fn bad_layouts_are_refused_with_reasons() {
    let mut l = ModelShape::LLAMA3_8B.layout(RegionId(0), 4);
    l.tensors[3].block_stride = 10;
    let e = l.validate(&region(1 << 30)).unwrap_err().to_string();
    assert!(e.contains("overlap"), "{e}");
    let mut l = ModelShape::LLAMA3_8B.layout(RegionId(9), 4);
    l.tensors.truncate(1);
    let e = l.validate(&region(1 << 30)).unwrap_err().to_string();
    assert!(e.contains("not registered"), "{e}");
    let mut l = ModelShape::LLAMA3_8B.layout(RegionId(0), 4);
    l.tensors[0].offset = u64::MAX - 5;
    assert!(l.validate(&region(u64::MAX)).is_err());
}

#[test]
fn differences_name_each_mismatch() {
    let a = ModelShape::LLAMA3_8B.layout(RegionId(0), 4);
    let mut b = ModelShape::LLAMA3_8B.layout(RegionId(1), 8);
    assert!(a.differences(&b).is_empty());
    b.tokens_per_block = 24;
    b.dtype = "fp16".into();
    b.tensors[5].block_bytes = 7;
    b.tensors[6].block_bytes = 7;
    let d = a.differences(&b).join("; ");
    assert!(d.contains("tokens_per_block 16 vs 24"), "{d}");
    assert!(d.contains("dtype"), "{d}");
    assert!(d.contains("tensor 5") && d.contains("1 more"), "{d}");
    let c = ModelShape::DEEPSEEK_V3_MLA.layout(RegionId(0), 4);
    assert!(a
        .differences(&c)
        .iter()
        .any(|s| s.contains("tensor count 64 vs 61")));
}

#[test]
fn numbered_layouts_and_buffer_splits() {
    let l = KvLayout::numbered(
        16,
        "bf16",
        [(RegionId(1), 0, 64, 64, 8), (RegionId(2), 0, 64, 64, 8)],
    );
    let names: Vec<&str> = l.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["t0", "t1"]);
    assert_eq!(l.tensors[1].region, RegionId(2));
    assert_eq!(KvLayout::split_buffer(4096, 8).unwrap(), (512, 8));
    for (nbytes, blocks) in [(4096, 0), (4097, 8), (0, 8), (1 << 40, 1 << 33)] {
        let e = KvLayout::split_buffer(nbytes, blocks)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot be split"), "{e}");
    }
}
