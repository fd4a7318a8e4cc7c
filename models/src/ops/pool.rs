//! Training's parallel loops on candle's barrier pool, the pool candle's own ops and our matrix
//! products run on (`ops::linear`): each helper hands every thread disjoint pieces of the
//! buffers it borrows, the calling thread working too. Training ran these loops on rayon
//! before; with two pools on two cores, four threads spun against each other for the cores
//! (rayon's workers took 15% of a 28M Llama step's samples).

/// A buffer's base pointer shared with the pool's threads, each of which touches only its own
/// pieces (the helpers below hand them out).
struct PiecesOf<T>(*mut T);
// SAFETY: the helpers give every thread disjoint pieces of a buffer they borrow mutably for
// the whole parallel region.
unsafe impl<T: Send> Sync for PiecesOf<T> {}
impl<T> PiecesOf<T> {
    /// Piece `c` of `chunk` elements (the last shorter) of a buffer of `len`.
    ///
    /// # Safety
    /// Each `c` must be used by one thread at a time, while the buffer is borrowed.
    // A mutable piece from a shared handle is the point: the threads share the handle and
    // the safety contract keeps their pieces apart.
    #[allow(clippy::mut_from_ref)]
    unsafe fn piece(&self, c: usize, chunk: usize, len: usize) -> &mut [T] {
        let lo = c * chunk;
        std::slice::from_raw_parts_mut(self.0.add(lo), chunk.min(len - lo))
    }
}
impl PiecesOf<f32> {
    /// The `n` values from `lo` of a buffer that may not be initialised, zeroed (zero bits are
    /// a valid f32), then borrowed.
    ///
    /// # Safety
    /// They must be inside the allocation, and used by one thread at a time while it is borrowed.
    #[allow(clippy::mut_from_ref)]
    unsafe fn zeroed(&self, lo: usize, n: usize) -> &mut [f32] {
        self.0.add(lo).write_bytes(0, n);
        std::slice::from_raw_parts_mut(self.0.add(lo), n)
    }
}

/// Runs `f(c, piece)` for every `chunk`-long piece `c` of `out` (the last may be shorter) on
/// candle's barrier pool, the calling thread included. Training's elementwise ops run here, on
/// the pool their matrix products run on: rayon's threads beside it spin against it for the
/// same cores.
pub fn pool_chunks_mut<T: Send>(out: &mut [T], chunk: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let (len, base) = (out.len(), PiecesOf(out.as_mut_ptr()));
    candle_core::utils::barrier_pool().execute_chunked(len.div_ceil(chunk.max(1)), |range| {
        for c in range {
            // SAFETY: chunk c goes to this thread only; `out` is borrowed for the call.
            f(c, unsafe { base.piece(c, chunk, len) })
        }
    })
}

/// [`pool_chunks_mut`] over two buffers cut into the same number of pieces (`a` in pieces of
/// `chunk_a`, `b` of `chunk_b`).
pub fn pool_chunks_mut2<T: Send, U: Send>(
    (a, chunk_a): (&mut [T], usize),
    (b, chunk_b): (&mut [U], usize),
    f: impl Fn(usize, &mut [T], &mut [U]) + Sync,
) {
    let pieces = a.len().div_ceil(chunk_a.max(1));
    assert_eq!(pieces, b.len().div_ceil(chunk_b.max(1)), "pool_chunks_mut2: the buffers cut into different numbers of pieces");
    let (len_a, len_b, pa, pb) = (a.len(), b.len(), PiecesOf(a.as_mut_ptr()), PiecesOf(b.as_mut_ptr()));
    candle_core::utils::barrier_pool().execute_chunked(pieces, |range| {
        for c in range {
            // SAFETY: piece c of both buffers goes to this thread only; both are borrowed.
            f(c, unsafe { pa.piece(c, chunk_a, len_a) }, unsafe { pb.piece(c, chunk_b, len_b) })
        }
    })
}

/// [`pool_chunks_mut`] that keeps what `f` returns for each piece, in piece order.
pub fn pool_map_chunks_mut<T: Send, R: Send + Sync>(out: &mut [T], chunk: usize, f: impl Fn(usize, &mut [T]) -> R + Sync) -> Vec<R> {
    let slots: Vec<std::sync::OnceLock<R>> = (0..out.len().div_ceil(chunk.max(1))).map(|_| std::sync::OnceLock::new()).collect();
    pool_chunks_mut(out, chunk, |c, piece| {
        let _ = slots[c].set(f(c, piece));
    });
    slots.into_iter().map(|s| s.into_inner().expect("every piece ran")).collect()
}

/// A new buffer of `len` values that `f(c, piece)` fills as [`pool_map_chunks_mut`] would fill
/// `vec![0.0; len]`, keeping what `f` returns per piece: each thread zeroes its own piece just
/// before handing it to `f`. `vec![0.0; len]` was a memset on the calling thread alone while the
/// pool's other threads spun (our ops' outputs: 2% of a 28M Llama step, `perf record` on a Zen 4),
/// and then a second pass over the buffer; a piece zeroed by its own thread is in its cache when
/// `f` writes it. The buffer has room for `room_after` more values, which the caller pushes (a
/// gradient's column sums after its rows) without moving it.
pub fn pool_map_new<R: Send + Sync>(
    len: usize,
    room_after: usize,
    chunk: usize,
    f: impl Fn(usize, &mut [f32]) -> R + Sync,
) -> (Vec<f32>, Vec<R>) {
    let chunk = chunk.max(1);
    let mut out: Vec<f32> = Vec::with_capacity(len + room_after);
    let base = PiecesOf(out.as_mut_ptr());
    let slots: Vec<std::sync::OnceLock<R>> = (0..len.div_ceil(chunk)).map(|_| std::sync::OnceLock::new()).collect();
    candle_core::utils::barrier_pool().execute_chunked(slots.len(), |range| {
        for c in range {
            // SAFETY: piece c is inside the capacity and goes to this thread only.
            let piece = unsafe { base.zeroed(c * chunk, chunk.min(len - c * chunk)) };
            let _ = slots[c].set(f(c, piece));
        }
    });
    // SAFETY: every piece of the first `len` values was zeroed above (execute_chunked runs all).
    unsafe { out.set_len(len) };
    (out, slots.into_iter().map(|s| s.into_inner().expect("every piece ran")).collect())
}

/// [`pool_map_new`] with nothing kept per piece and no room after.
pub fn pool_new(len: usize, chunk: usize, f: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    pool_map_new(len, 0, chunk, f).0
}

/// A new buffer of `2 * half` values filled as [`pool_chunks_mut2`] fills its two buffers: the
/// first `half` values in pieces of `chunk`, the second likewise, piece `c` of each to
/// `f(c, first, second)`, each zeroed by its thread first (see [`pool_map_new`]).
pub fn pool_new_halves(half: usize, chunk: usize, f: impl Fn(usize, &mut [f32], &mut [f32]) + Sync) -> Vec<f32> {
    let chunk = chunk.max(1);
    let mut out: Vec<f32> = Vec::with_capacity(2 * half);
    let base = PiecesOf(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(half.div_ceil(chunk), |range| {
        for c in range {
            let n = chunk.min(half - c * chunk);
            // SAFETY: piece c of either half is inside the capacity and goes to this thread only.
            let (a, b) = unsafe { (base.zeroed(c * chunk, n), base.zeroed(half + c * chunk, n)) };
            f(c, a, b);
        }
    });
    // SAFETY: every piece of both halves was zeroed above.
    unsafe { out.set_len(2 * half) };
    out
}

/// `f(i)` for every `i` in `0..n` on candle's barrier pool, in order.
pub fn pool_map<R: Send + Sync>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let slots: Vec<std::sync::OnceLock<R>> = (0..n).map(|_| std::sync::OnceLock::new()).collect();
    candle_core::utils::barrier_pool().execute_chunked(n, |range| {
        for i in range {
            let _ = slots[i].set(f(i));
        }
    });
    slots.into_iter().map(|s| s.into_inner().expect("every task ran")).collect()
}

/// Runs `task(scratch, i)` for every `i` in `0..n` on candle's barrier pool, the calling thread
/// included, each thread's range of tasks sharing one `scratch` from `init` (rayon's
/// `for_each_init`): training's attention runs on the pool its products run on.
pub fn on_pool<S>(n: usize, init: impl Fn() -> S + Sync, task: impl Fn(&mut S, usize) + Sync) {
    candle_core::utils::barrier_pool().execute_chunked(n, |range| {
        let mut scratch = init();
        for i in range {
            task(&mut scratch, i);
        }
    })
}

/// Values per piece of the pool's copies and sums: big enough that handing out a piece costs
/// nothing beside it, small enough that both threads get several.
const ELEMENTWISE_PIECE: usize = 1 << 16;

/// `dst += src` over the pool (one pass of memory traffic per thread instead of one thread's).
pub fn pool_add_into(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "pool_add_into: lengths differ");
    if dst.len() < ELEMENTWISE_PIECE {
        dst.iter_mut().zip(src).for_each(|(a, b)| *a += *b);
        return;
    }
    pool_chunks_mut(dst, ELEMENTWISE_PIECE, |c, piece| piece.iter_mut().zip(&src[c * ELEMENTWISE_PIECE..]).for_each(|(a, b)| *a += *b))
}

/// A copy of `src` made over the pool (into memory not zeroed first: every value is written).
pub fn pool_to_vec<T: Copy + Send + Sync>(src: &[T]) -> Vec<T> {
    use std::mem::MaybeUninit;
    if src.len() < ELEMENTWISE_PIECE {
        return src.to_vec();
    }
    let mut out: Vec<MaybeUninit<T>> = Vec::with_capacity(src.len());
    // SAFETY: MaybeUninit values need no initialisation; the capacity is src.len().
    unsafe { out.set_len(src.len()) };
    pool_chunks_mut(&mut out, ELEMENTWISE_PIECE, |c, piece| {
        for (o, x) in piece.iter_mut().zip(&src[c * ELEMENTWISE_PIECE..]) {
            o.write(*x);
        }
    });
    let mut out = std::mem::ManuallyDrop::new(out);
    // SAFETY: every element was written above; MaybeUninit<T> has T's layout.
    unsafe { Vec::from_raw_parts(out.as_mut_ptr().cast::<T>(), out.len(), out.capacity()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every piece reaches `f` zeroed (what `vec![0.0; len]` gave), in pieces of the chunk with
    /// a shorter last one, and comes back filled; room is left after; the halves pair up.
    #[test]
    fn new_buffers_are_zeroed_piece_by_piece_then_filled() {
        let (len, chunk) = (1000, 64);
        let (out, kept) = pool_map_new(len, 7, chunk, |c, piece| {
            let zeroed = piece.iter().all(|v| v.to_bits() == 0);
            piece.iter_mut().enumerate().filter(|(i, _)| i % 2 == 0).for_each(|(i, v)| *v = (c * chunk + i) as f32);
            (zeroed, piece.len())
        });
        assert!(kept.iter().all(|(zeroed, _)| *zeroed), "a piece came to f not zeroed");
        assert_eq!(kept.iter().map(|(_, n)| n).sum::<usize>(), len);
        assert_eq!(kept.last().unwrap().1, len % chunk);
        assert!(out.capacity() >= len + 7 && out.len() == len);
        assert!(out.iter().enumerate().all(|(i, v)| *v == if i % 2 == 0 { i as f32 } else { 0.0 }));

        let halves = pool_new_halves(300, 64, |c, a, b| {
            assert!(a.iter().chain(b.iter()).all(|v| v.to_bits() == 0) && a.len() == b.len());
            a.iter_mut().enumerate().for_each(|(i, v)| *v = (c * 64 + i) as f32);
            b.iter_mut().enumerate().for_each(|(i, v)| *v = -((c * 64 + i) as f32));
        });
        assert!((0..300).all(|i| halves[i] == i as f32 && halves[300 + i] == -(i as f32)));
    }
}
