//! [`ColumnsMut`]: exclusive access to a range of columns of a row-major buffer whose other
//! columns other threads may be writing at the same time.
//!
//! Tasks of the pool that split a `[rows, stride]` buffer by columns (the GDN conv by channel,
//! the GDN heads by value head) must not each hold a `&mut [f32]` over the whole buffer: two
//! live `&mut` slices that overlap are undefined behaviour even if the elements written are
//! disjoint. A `ColumnsMut` holds a raw pointer instead and hands out one row's columns at a
//! time, so the only `&mut` slices that exist cover elements no other task touches.

use std::marker::PhantomData;
use std::ops::Range;

/// Columns `cols` of rows `0..rows` of a row-major buffer with `stride` floats per row, for
/// reading and writing by one owner (see [`ColumnsMut::new`]).
#[derive(Debug)]
pub struct ColumnsMut<'a> {
    /// Element `(0, 0)` of the buffer (not of the range).
    base: *mut f32,
    rows: usize,
    stride: usize,
    cols: Range<usize>,
    _buf: PhantomData<&'a mut [f32]>,
}

impl<'a> ColumnsMut<'a> {
    /// Columns `cols` of `rows` rows of `stride` floats from `base`.
    ///
    /// # Safety
    /// For `'a`: `base` is valid for reads and writes of element `(r, c)` (at
    /// `base + r·stride + c`) for every `r < rows`, `c` in `cols`, and no other pointer or
    /// reference accesses those elements (other columns, and rows outside `0..rows`, may be
    /// accessed concurrently). `cols.start ≤ cols.end ≤ stride` unless `rows` is 0.
    pub unsafe fn new(base: *mut f32, rows: usize, stride: usize, cols: Range<usize>) -> Self {
        debug_assert!(rows == 0 || (cols.start <= cols.end && cols.end <= stride));
        Self { base, rows, stride, cols, _buf: PhantomData }
    }

    /// Columns `cols` of the first `rows` rows of `buf` (`stride` floats per row): the safe form
    /// for a single owner (tests, one thread).
    pub fn from_slice(buf: &'a mut [f32], rows: usize, stride: usize, cols: Range<usize>) -> Self {
        assert!(cols.start <= cols.end && cols.end <= stride, "columns {cols:?} of rows of {stride}");
        assert!(rows == 0 || (rows - 1) * stride + cols.end <= buf.len(), "{rows} rows of {stride} in {} floats", buf.len());
        // SAFETY: `buf` is borrowed uniquely for 'a and holds every element of the range.
        unsafe { Self::new(buf.as_mut_ptr(), rows, stride, cols) }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The range's columns (of the whole buffer).
    pub fn cols(&self) -> Range<usize> {
        self.cols.clone()
    }

    /// Floats from one row to the next.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// The range's columns of row `r`: element `i` is column `cols().start + i`.
    #[inline(always)]
    pub fn row(&mut self, r: usize) -> &mut [f32] {
        assert!(r < self.rows, "row {r} of {}", self.rows);
        // SAFETY: row r's columns lie in the buffer and belong to this value alone (`new`); the
        // slice borrows `self`, so no other slice of this value is live at the same time.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(r * self.stride + self.cols.start), self.cols.len()) }
    }

    /// Element `(0, 0)` of the whole buffer, for kernels that address it with raw pointers
    /// (`base + r·stride() + c`): through it, only elements with `r < rows()` and `c` in `cols()`
    /// may be accessed, and only while this value stays borrowed. Accesses through a raw pointer
    /// make no `&mut` slice, so they alias nothing another task holds.
    pub fn as_mut_ptr(&mut self) -> *mut f32 {
        self.base
    }

    /// Columns `cols` (a sub-range of this value's) of the same rows, for as long as it is
    /// borrowed.
    pub fn sub(&mut self, cols: Range<usize>) -> ColumnsMut<'_> {
        assert!(self.cols.start <= cols.start && cols.start <= cols.end && cols.end <= self.cols.end, "columns {cols:?} of {:?}", self.cols);
        // SAFETY: a sub-range of this value's elements, which `&mut self` lends it alone.
        unsafe { ColumnsMut::new(self.base, self.rows, self.stride, cols) }
    }
}

#[cfg(test)]
mod tests {
    use super::ColumnsMut;

    #[test]
    fn rows_and_sub_ranges_address_their_columns() {
        let mut buf: Vec<f32> = (0..3 * 10 - 2).map(|i| i as f32).collect();
        let mut c = ColumnsMut::from_slice(&mut buf, 3, 10, 4..8);
        assert_eq!(c.row(2), &[24.0, 25.0, 26.0, 27.0]);
        c.sub(6..8).row(1).fill(-1.0);
        assert_eq!(c.row(1), &[14.0, 15.0, -1.0, -1.0]);
        assert_eq!(buf[16..18], [-1.0, -1.0]);
    }

    #[test]
    #[should_panic]
    fn rows_past_the_end_panic() {
        let mut buf = vec![0.0f32; 20];
        ColumnsMut::from_slice(&mut buf, 2, 10, 0..10).row(2);
    }
}
