//! The benches' random tokens: xorshift64 from a fixed seed, token ids uniform in
//! [0, 50,000) (issue 17's workloads).

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (self.next() % 50_000) as u32).collect()
    }
}
