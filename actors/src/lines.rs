//! Cache lines moved between threads together rather than one at a time.
//!
//! A loop that fills (or reads) a list another thread touched last takes each line over from
//! the other core as it reaches it. Where the loop's stores cannot retire early (a Rust move
//! through the stack that a wider load cannot forward from, a lock taken per item), each of
//! those trips is waited out in turn. Touching every line first, back to back, lets the trips
//! overlap (BENCHMARKS: "A step's row lists owned before they are filled").

/// Writes every cache line of `spare` once, back to back, so that this thread owns them before
/// it fills them row by row.
pub(crate) fn own_lines<T>(spare: &mut [std::mem::MaybeUninit<T>]) {
    let bytes = std::mem::size_of_val(spare);
    let start = spare.as_mut_ptr().cast::<u8>();
    // Every 64th byte and the last: one in each line the capacity touches, however aligned.
    for at in (0..bytes).step_by(64).chain(bytes.checked_sub(1)) {
        // SAFETY: `at` is inside the `bytes`-long spare capacity; any byte may be written there.
        unsafe { start.add(at).write_volatile(0) };
    }
}

/// Reads every cache line of `items` once, back to back: lines another thread wrote arrive
/// together rather than one by one as a loop over the items reaches them.
pub(crate) fn pull_lines<T>(items: &[T]) {
    let bytes = std::mem::size_of_val(items);
    // Read as possibly uninitialized bytes: a byte may be an item's padding.
    let start = items.as_ptr().cast::<std::mem::MaybeUninit<u8>>();
    for at in (0..bytes).step_by(64).chain(bytes.checked_sub(1)) {
        // SAFETY: `at` is inside the `bytes`-long slice, read as a `MaybeUninit` byte.
        unsafe { start.add(at).read_volatile() };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_touched_without_changing_what_they_hold() {
        let mut list: Vec<(u8, u64)> = Vec::with_capacity(100);
        list.extend((0..10).map(|i| (i, u64::from(i) * 3)));
        own_lines(list.spare_capacity_mut());
        list.extend((10..100).map(|i| (i, u64::from(i) * 3)));
        pull_lines(&list[1..]);
        pull_lines::<u64>(&[]);
        own_lines::<u8>(&mut []);
        assert!(
            list.iter()
                .enumerate()
                .all(|(i, &(a, b))| a as usize == i && b == 3 * i as u64)
        );
    }
}
