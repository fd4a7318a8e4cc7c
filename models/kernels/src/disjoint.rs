//! The one way our parallel kernels write a shared buffer: every thread gets the buffer's
//! address and writes only places that no other thread touches during the parallel region.

use std::marker::PhantomData;

/// A buffer borrowed mutably for a parallel region and shared by its threads, each writing
/// (or reading back) places no other thread uses while the region runs.
///
/// The borrow (`'a`) keeps the buffer alive and unaliased for as long as the handle exists;
/// which places belong to which thread is the caller's part, stated at each `unsafe` call.
pub struct DisjointWrites<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: the invariant of this type, stated once: the handle stands for an exclusive borrow of
// `len` elements at `ptr` for `'a`, and every user of `piece`/`at` keeps the places it touches
// apart from every other thread's (each call's safety contract). Sharing the handle across
// threads then only lets disjoint `&mut` pieces exist at once, which is what `&mut [T]` split
// with `split_at_mut` allows; `T: Send` because the elements are written from other threads.
unsafe impl<T: Send> Sync for DisjointWrites<'_, T> {}
// SAFETY: as above; the handle holds no thread-bound state.
unsafe impl<T: Send> Send for DisjointWrites<'_, T> {}

impl<'a, T> DisjointWrites<'a, T> {
    pub fn new(buf: &'a mut [T]) -> Self {
        Self { ptr: buf.as_mut_ptr(), len: buf.len(), _borrow: PhantomData }
    }

    /// A handle over a `Vec`'s first `len` places of spare capacity (not yet initialised): for
    /// buffers that the threads fill before `set_len`.
    ///
    /// # Panics
    /// When the capacity is less than `len`.
    pub fn spare(buf: &'a mut Vec<T>, len: usize) -> Self {
        assert!(buf.capacity() >= len, "DisjointWrites::spare: capacity {} < {len}", buf.capacity());
        Self { ptr: buf.as_mut_ptr(), len, _borrow: PhantomData }
    }

    /// A handle over `len` places at `ptr` (possibly uninitialised), for kernels handed a raw
    /// output pointer.
    ///
    /// # Safety
    /// `ptr` must be valid for `len` writes for `'a`, and nothing else may use those places
    /// meanwhile except through this handle.
    pub unsafe fn from_raw(ptr: *mut T, len: usize) -> Self {
        Self { ptr, len, _borrow: PhantomData }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The places `range` as a slice (bounds checked).
    ///
    /// # Safety
    /// No other thread may use any place of `range` while the slice lives, and the places must
    /// be initialised before they are read (a handle from [`Self::spare`] starts uninitialised).
    // A mutable piece from a shared handle is the point: the threads share the handle and the
    // contract keeps their pieces apart.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn piece(&self, range: std::ops::Range<usize>) -> &mut [T] {
        assert!(range.start <= range.end && range.end <= self.len, "DisjointWrites: {range:?} outside {}", self.len);
        std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.end - range.start)
    }

    /// The address of place `i` (bounds checked), for kernels that write strided places.
    ///
    /// # Safety
    /// No other thread may use place `i` while the pointer is used.
    pub unsafe fn at(&self, i: usize) -> *mut T {
        assert!(i < self.len, "DisjointWrites: place {i} outside {}", self.len);
        self.ptr.add(i)
    }

    /// The base address, for kernels that take a pointer and strides (the matrix products).
    ///
    /// # Safety
    /// What the kernel writes through it must be places no other thread uses meanwhile, inside
    /// the `len` places.
    pub unsafe fn base(&self) -> *mut T {
        self.ptr
    }
}

impl DisjointWrites<'_, f32> {
    /// The `range` places zeroed (zero bits are a valid f32), then borrowed: a piece of a
    /// [`Self::spare`] buffer that its thread initialises itself.
    ///
    /// # Safety
    /// As [`Self::piece`] (the places need no initialisation).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn zeroed(&self, range: std::ops::Range<usize>) -> &mut [f32] {
        assert!(range.start <= range.end && range.end <= self.len, "DisjointWrites: {range:?} outside {}", self.len);
        self.ptr.add(range.start).write_bytes(0, range.end - range.start);
        std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.end - range.start)
    }
}

#[cfg(test)]
mod tests {
    use super::DisjointWrites;

    /// Threads writing disjoint pieces and strided places fill the buffer as one thread would.
    #[test]
    fn threads_fill_their_own_places() {
        let mut buf = vec![0u32; 1000];
        let out = DisjointWrites::new(&mut buf);
        std::thread::scope(|s| {
            for t in 0..4 {
                let out = &out;
                s.spawn(move || {
                    // SAFETY: thread t owns the places congruent to t mod 4.
                    (t..1000).step_by(4).for_each(|i| unsafe { *out.at(i) = i as u32 * 2 });
                });
            }
        });
        assert!(buf.iter().enumerate().all(|(i, v)| *v == i as u32 * 2));
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn a_piece_past_the_end_is_refused() {
        let mut buf = vec![0f32; 8];
        let out = DisjointWrites::new(&mut buf);
        // SAFETY: one thread; the call panics before any access.
        let _ = unsafe { out.piece(4..9) };
    }
}
