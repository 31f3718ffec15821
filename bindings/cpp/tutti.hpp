// tutti.hpp: a header-only C++17 wrapper over tutti's C API (include/tutti.h).
//
// Handles are move-only RAII objects; every failure throws tutti::error carrying the
// tutti_result code and the message of tutti_last_error. Buffers are typed: the dtype comes
// from the element type (float, double, int8_t ... uint64_t, tutti::f16, tutti::bf16).
//
//     auto comms = tutti::comm::group(4, tutti::config().timeout(std::chrono::seconds(30)));
//     // on rank r's thread:
//     comms[r].all_reduce(grad, tutti::op::mean);
//
// Thread-safety is the C API's: one collective at a time per communicator, abort() from any
// thread.
#ifndef TUTTI_HPP
#define TUTTI_HPP

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tutti.h"

namespace tutti {

/// A failed call: the tutti_result code and what went wrong (tutti_last_error).
class error : public std::runtime_error {
public:
    error(tutti_result code, const std::string &message)
        : std::runtime_error(message), code_(code) {}
    /// The TUTTI_ERROR_* code.
    tutti_result code() const noexcept { return code_; }
    /// What the code means and what to do next.
    const char *code_string() const noexcept { return tutti_result_string(code_); }

private:
    tutti_result code_;
};

namespace detail {

/// The calling thread's last error message.
inline std::string last_error() {
    std::size_t n = tutti_last_error(nullptr, 0);
    std::string s(n + 1, '\0');
    tutti_last_error(&s[0], s.size());
    s.resize(n);
    return s;
}

/// Throw tutti::error unless the call succeeded.
inline void check(tutti_result r) {
    if (r != TUTTI_SUCCESS) {
        throw error(r, last_error());
    }
}

struct comm_deleter {
    void operator()(tutti_comm *c) const noexcept { tutti_comm_destroy(c); }
};
struct work_deleter {
    void operator()(tutti_work *w) const noexcept { tutti_work_destroy(w); }
};
struct replicas_deleter {
    void operator()(tutti_replicas *r) const noexcept { tutti_replicas_destroy(r); }
};

} // namespace detail

/// IEEE binary16, as its bits.
struct f16 {
    std::uint16_t bits;
};
/// bfloat16, as its bits (the upper half of a float).
struct bf16 {
    std::uint16_t bits;
};

/// The tutti_dtype of an element type.
template <typename T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr tutti_dtype value = TUTTI_DTYPE_F32; };
template <> struct dtype_of<double> { static constexpr tutti_dtype value = TUTTI_DTYPE_F64; };
template <> struct dtype_of<f16> { static constexpr tutti_dtype value = TUTTI_DTYPE_F16; };
template <> struct dtype_of<bf16> { static constexpr tutti_dtype value = TUTTI_DTYPE_BF16; };
template <> struct dtype_of<std::int8_t> { static constexpr tutti_dtype value = TUTTI_DTYPE_I8; };
template <> struct dtype_of<std::uint8_t> { static constexpr tutti_dtype value = TUTTI_DTYPE_U8; };
template <> struct dtype_of<std::int32_t> { static constexpr tutti_dtype value = TUTTI_DTYPE_I32; };
template <> struct dtype_of<std::uint32_t> {
    static constexpr tutti_dtype value = TUTTI_DTYPE_U32;
};
template <> struct dtype_of<std::int64_t> { static constexpr tutti_dtype value = TUTTI_DTYPE_I64; };
template <> struct dtype_of<std::uint64_t> {
    static constexpr tutti_dtype value = TUTTI_DTYPE_U64;
};

/// Reduce operations.
enum class op : std::uint32_t {
    sum = TUTTI_OP_SUM,
    prod = TUTTI_OP_PROD,
    min = TUTTI_OP_MIN,
    max = TUTTI_OP_MAX,
    mean = TUTTI_OP_MEAN,
    avg = TUTTI_OP_MEAN,
    band = TUTTI_OP_BAND,  ///< integer dtypes only
    bor = TUTTI_OP_BOR,    ///< integer dtypes only
    bxor = TUTTI_OP_BXOR,  ///< integer dtypes only
};

/// An algorithm and its argument (group size of hierarchical copy, root of reduce-to-one).
struct algorithm {
    tutti_algorithm kind = TUTTI_ALGORITHM_AUTO;
    std::uint32_t arg = 0;

    static algorithm automatic() { return {TUTTI_ALGORITHM_AUTO, 0}; }
    static algorithm direct() { return {TUTTI_ALGORITHM_DIRECT, 0}; }
    static algorithm ring() { return {TUTTI_ALGORITHM_RING, 0}; }
    static algorithm hierarchical_copy(std::uint32_t group_size = 2) {
        return {TUTTI_ALGORITHM_HIERARCHICAL_COPY, group_size};
    }
    static algorithm reduce_to_one(std::uint32_t root = 0) {
        return {TUTTI_ALGORITHM_REDUCE_TO_ONE, root};
    }
    static algorithm recursive_doubling() { return {TUTTI_ALGORITHM_RECURSIVE_DOUBLING, 0}; }
    static algorithm rabenseifner() { return {TUTTI_ALGORITHM_RABENSEIFNER, 0}; }
    static algorithm hosts() { return {TUTTI_ALGORITHM_HOSTS, 0}; }
    bool operator==(const algorithm &o) const { return kind == o.kind && arg == o.arg; }
    bool operator!=(const algorithm &o) const { return !(*this == o); }
};

/// Settings of a new group; every field defaults.
class config {
public:
    config() : c_(TUTTI_CONFIG_INIT) {}
    config &timeout(std::chrono::milliseconds t) {
        c_.timeout_ms = static_cast<std::uint64_t>(t.count());
        return *this;
    }
    config &with_algorithm(algorithm a) {
        c_.algorithm = a.kind;
        c_.algorithm_arg = a.arg;
        return *this;
    }
    config &chunk_bytes(std::size_t n) {
        c_.chunk_bytes = n;
        return *this;
    }
    /// How the ranks of a multi-process communicator reach each other.
    config &transport(tutti_transport t) {
        c_.transport = t;
        return *this;
    }
    /// Bitwise-deterministic reductions on or off (default: `TUTTI_DETERMINISTIC`).
    config &deterministic(bool on) {
        c_.deterministic = on ? 1u : 2u;
        return *this;
    }
    /// How f32 all-reduce and reduce-scatter travel between hosts: `TUTTI_COMPRESSION_BF16`
    /// or `_F16` (reduced in f32), `_NONE` (default: `TUTTI_COMPRESSION`).
    config &compression(tutti_compression c) {
        c_.compression = c;
        return *this;
    }
    const tutti_config *get() const noexcept { return &c_; }

private:
    tutti_config c_;
};

/// The handle of a non-blocking collective (`comm::all_reduce_async` and friends). Move-only;
/// destroying a pending one waits for its call (bounded by the communicator's timeout). The
/// buffers must outlive the call.
class work {
public:
    explicit work(tutti_work *handle) noexcept : h_(handle) {}
    /// Wait until the call completes; throws its error.
    void wait() { detail::check(tutti_work_wait(h_.get(), 0)); }
    /// Wait up to `bound`; throws `error` with `TUTTI_ERROR_WAIT_TIMEOUT` when the call still
    /// runs (nothing failed; it goes on, and the handle stays valid).
    void wait(std::chrono::milliseconds bound) {
        std::uint64_t ms = bound.count() > 0 ? static_cast<std::uint64_t>(bound.count()) : 1;
        detail::check(tutti_work_wait(h_.get(), ms));
    }
    /// True once the call has completed; never blocks.
    bool test() const {
        bool done = false;
        detail::check(tutti_work_test(h_.get(), &done));
        return done;
    }

private:
    std::unique_ptr<tutti_work, detail::work_deleter> h_;
};

/// A group of point-to-point calls on the calling thread (tutti_group_start /
/// tutti_group_end, as NCCL's ncclGroupStart/End): while it is open, `comm::send` and
/// `comm::recv` on any communicator are recorded, and `end()` runs them all at once, so a ring
/// or two ranks that both send first cannot deadlock. Groups nest; only the outermost end runs
/// the calls. Collectives and the `_async` point-to-point calls throw inside a group.
///
///     {
///         tutti::group g;
///         c.send(out.data(), n, next);
///         c.recv(in.data(), n, prev);
///         g.end(); // throws the first error
///     }
///
/// or, to overlap the exchange with other work, `std::optional<tutti::work> w = g.end_async();`
/// and `w->wait()` before the buffers are touched.
///
/// The recorded buffers must outlive the guard: declare them before it. The destructor of a
/// group not ended yet (an exception left the scope) ends it, running the recorded calls, and
/// drops any error (call `end()` to see it). Not movable: the group belongs to its thread.
class group {
public:
    group() { detail::check(tutti_group_start()); }
    group(const group &) = delete;
    group &operator=(const group &) = delete;
    /// Close the group (running the recorded calls, if it is the outermost) and throw the
    /// first error. Once only.
    void end() {
        if (!open_) {
            throw error(TUTTI_ERROR_INVALID_ARGUMENT, "tutti::group::end: the group has ended");
        }
        open_ = false;
        detail::check(tutti_group_end());
    }
    /// Close the group without waiting (tutti_group_end_async): the handle of the recorded
    /// calls, which completes when they all have (their buffers must outlive it), or none when
    /// nothing was issued (an inner group: the outermost end runs its calls; or nothing was
    /// recorded). The calls must be on one communicator. On an error (calls on several
    /// communicators, one destroyed) the group and the guard stay open: `end()` or the
    /// destructor runs what is recorded. Once only.
    std::optional<work> end_async() {
        if (!open_) {
            throw error(TUTTI_ERROR_INVALID_ARGUMENT,
                        "tutti::group::end_async: the group has ended");
        }
        tutti_work *h = nullptr;
        detail::check(tutti_group_end_async(&h));
        open_ = false;
        if (h == nullptr) {
            return std::nullopt;
        }
        return work(h);
    }
    ~group() {
        if (open_) {
            (void)tutti_group_end();
        }
    }

private:
    bool open_ = true;
};

/// Memory from tutti_mem_alloc, as `size()` elements of T, released with tutti_mem_free when
/// this object goes. It keeps its communicator alive: the C handle is destroyed once both the
/// `comm` and every shared_array from it are gone, so an array that outlives its `comm` object
/// never frees through a dangling handle. Freed memory is unmapped once the calls issued
/// before the free have completed (a non-blocking call on it may still be queued). Collectives
/// whose buffers are in such memory on every rank skip the shared-memory slots between
/// processes (README: "Zero-copy between processes: shared buffers"). Made by
/// comm::alloc_shared.
template <typename T> class shared_array {
public:
    shared_array(std::shared_ptr<tutti_comm> owner, T *data, std::size_t n) noexcept
        : owner_(std::move(owner)), data_(data), n_(n) {}
    shared_array(shared_array &&o) noexcept
        : owner_(std::move(o.owner_)), data_(o.data_), n_(o.n_) {
        o.data_ = nullptr;
        o.n_ = 0;
    }
    shared_array &operator=(shared_array &&o) noexcept {
        if (this != &o) {
            release();
            owner_ = std::move(o.owner_);
            data_ = o.data_;
            n_ = o.n_;
            o.data_ = nullptr;
            o.n_ = 0;
        }
        return *this;
    }
    shared_array(const shared_array &) = delete;
    shared_array &operator=(const shared_array &) = delete;
    ~shared_array() { release(); }

    T *data() noexcept { return data_; }
    const T *data() const noexcept { return data_; }
    std::size_t size() const noexcept { return n_; }
    T &operator[](std::size_t i) noexcept { return data_[i]; }
    const T &operator[](std::size_t i) const noexcept { return data_[i]; }
    T *begin() noexcept { return data_; }
    T *end() noexcept { return data_ + n_; }

private:
    void release() noexcept {
        if (data_ != nullptr && owner_) {
            tutti_mem_free(owner_.get(), data_); // fails only on memory it did not hand out
        }
        data_ = nullptr;
        n_ = 0;
        owner_.reset(); // the last owner destroys the communicator
    }
    std::shared_ptr<tutti_comm> owner_;
    T *data_;
    std::size_t n_;
};

/// One rank's handle on a group. Move-only; released when it goes out of scope.
class comm {
public:
    /// An in-process group of `world_size` ranks: element r is rank r's communicator; hand
    /// each to its own thread.
    static std::vector<comm> group(std::size_t world_size, const config &cfg = config()) {
        std::vector<tutti_comm *> raw(world_size, nullptr);
        detail::check(tutti_comm_create_group(world_size, cfg.get(), raw.data()));
        std::vector<comm> out;
        out.reserve(world_size);
        for (tutti_comm *c : raw) {
            out.push_back(comm(c));
        }
        return out;
    }

    /// A group whose rank r is on `devices[r]` ("cpu:0", "xla:1", "cuda:2"): element r is
    /// rank r's communicator; hand each to its own thread. Buffers are the rank's device
    /// memory (host memory for cpu and xla ranks, CUDA device pointers for cuda ranks).
    static std::vector<comm> devices(const std::vector<std::string> &specs,
                                     const config &cfg = config()) {
        std::vector<const char *> names;
        names.reserve(specs.size());
        for (const std::string &s : specs) {
            names.push_back(s.c_str());
        }
        std::vector<tutti_comm *> raw(specs.size(), nullptr);
        detail::check(tutti_comm_create_devices(specs.size(), names.data(), cfg.get(), raw.data()));
        std::vector<comm> out;
        out.reserve(specs.size());
        for (tutti_comm *c : raw) {
            out.push_back(comm(c));
        }
        return out;
    }

    /// Join the multi-process job this process's environment describes (tutti launch,
    /// torchrun, mpirun, srun, TF_CONFIG or TUTTI_RANK/TUTTI_WORLD_SIZE/TUTTI_MASTER_ADDR).
    static comm from_env(const config &cfg = config()) {
        tutti_comm *c = nullptr;
        detail::check(tutti_comm_create_from_env(cfg.get(), &c));
        return comm(c);
    }

    /// Join a multi-process job as `rank` of `world_size`, meeting at `master_addr`
    /// ("host:port", served by rank 0).
    static comm join(std::size_t rank, std::size_t world_size, const std::string &master_addr,
                     const config &cfg = config()) {
        tutti_comm *c = nullptr;
        detail::check(tutti_comm_create_rank(rank, world_size, master_addr.c_str(), cfg.get(), &c));
        return comm(c);
    }

    /// Split this communicator (collective, as `tutti_comm_split`): the ranks with the same
    /// `color` (0 or more) form a new communicator ranked by `key`, then rank; a negative color
    /// gets none (a null pointer).
    std::unique_ptr<comm> split(std::int64_t color, std::int64_t key) {
        tutti_comm *c = nullptr;
        detail::check(tutti_comm_split(h_.get(), color, key, &c));
        return c == nullptr ? nullptr : std::unique_ptr<comm>(new comm(c));
    }

    /// After a rank was lost: a new communicator of the ranks still alive, renumbered
    /// (every survivor calls it; as `tutti_comm_shrink`). This one is aborted.
    comm shrink() {
        tutti_comm *c = nullptr;
        detail::check(tutti_comm_shrink(h_.get(), &c));
        return comm(c);
    }

    /// Takes ownership of a handle from the C API.
    explicit comm(tutti_comm *handle) : h_(handle, detail::comm_deleter()) {}
    comm(comm &&) noexcept = default;
    comm &operator=(comm &&) noexcept = default;
    comm(const comm &) = delete;
    comm &operator=(const comm &) = delete;

    std::size_t rank() const {
        std::size_t r = 0;
        detail::check(tutti_comm_rank(h_.get(), &r));
        return r;
    }
    std::size_t world_size() const {
        std::size_t n = 0;
        detail::check(tutti_comm_world_size(h_.get(), &n));
        return n;
    }
    std::chrono::milliseconds timeout() const {
        std::uint64_t ms = 0;
        detail::check(tutti_comm_timeout_ms(h_.get(), &ms));
        return std::chrono::milliseconds(static_cast<std::chrono::milliseconds::rep>(ms));
    }
    algorithm get_algorithm() const {
        algorithm a;
        detail::check(tutti_comm_algorithm(h_.get(), &a.kind, &a.arg));
        return a;
    }
    /// Every rank must make the same choice before its next collective.
    void set_algorithm(algorithm a) { detail::check(tutti_comm_set_algorithm(h_.get(), a.kind, a.arg)); }
    /// cuda:N ranks: order later collectives on `stream` as NCCL does (a cudaStream_t; nullptr:
    /// the legacy default stream); `unset_cuda_stream` goes back to none.
    void set_cuda_stream(void *stream) { detail::check(tutti_comm_set_cuda_stream(h_.get(), stream)); }
    void unset_cuda_stream() { detail::check(tutti_comm_unset_cuda_stream(h_.get())); }
    /// Wake every blocked collective of the group and fail later ones; callable from any thread.
    void abort(const std::string &reason = std::string()) const {
        detail::check(tutti_comm_abort(h_.get(), reason.empty() ? nullptr : reason.c_str()));
    }
    bool aborted() const {
        bool a = false;
        detail::check(tutti_comm_is_aborted(h_.get(), &a));
        return a;
    }

    /// output = op over ranks of input (`input == output`: in place).
    template <typename T> void all_reduce(const T *input, T *output, std::size_t count, op o) {
        detail::check(tutti_all_reduce(h_.get(), count, dtype_of<T>::value,
                                       static_cast<tutti_op>(o), input, output));
    }
    /// In place over a vector.
    template <typename T> void all_reduce(std::vector<T> &buf, op o) {
        all_reduce(buf.data(), buf.data(), buf.size(), o);
    }
    template <typename T> void broadcast(T *buf, std::size_t count, std::size_t root) {
        detail::check(tutti_broadcast(h_.get(), count, dtype_of<T>::value, root, buf));
    }
    template <typename T> void broadcast(std::vector<T> &buf, std::size_t root) {
        broadcast(buf.data(), buf.size(), root);
    }
    /// output (world_size × count) = every rank's input in rank order.
    template <typename T> void all_gather(const T *input, T *output, std::size_t count) {
        detail::check(tutti_all_gather(h_.get(), count, dtype_of<T>::value, input, output));
    }
    template <typename T> std::vector<T> all_gather(const std::vector<T> &input) {
        std::vector<T> out(input.size() * world_size());
        all_gather(input.data(), out.data(), input.size());
        return out;
    }
    /// output (count) = slice `rank` of op over every rank's input (world_size × count).
    template <typename T>
    void reduce_scatter(const T *input, T *output, std::size_t count, op o) {
        detail::check(tutti_reduce_scatter(h_.get(), count, dtype_of<T>::value,
                                           static_cast<tutti_op>(o), input, output));
    }
    /// output = sum over ranks of each rank's input scaled by its own `factor` (NCCL's
    /// pre-multiplied sum; `input == output`: in place). Host memory.
    template <typename T>
    void all_reduce_premul_sum(const T *input, T *output, std::size_t count, double factor) {
        detail::check(tutti_all_reduce_premul_sum(h_.get(), count, dtype_of<T>::value, factor,
                                                  input, output));
    }
    /// In place over a vector.
    template <typename T> void all_reduce_premul_sum(std::vector<T> &buf, double factor) {
        all_reduce_premul_sum(buf.data(), buf.data(), buf.size(), factor);
    }
    /// output (count) = slice `rank` of the sum over ranks of each rank's input (world_size ×
    /// count) scaled by its own `factor`.
    template <typename T>
    void reduce_scatter_premul_sum(const T *input, T *output, std::size_t count, double factor) {
        detail::check(tutti_reduce_scatter_premul_sum(h_.get(), count, dtype_of<T>::value,
                                                      factor, input, output));
    }
    /// At the root, output = op over every rank's input; elsewhere output may be null.
    template <typename T>
    void reduce(const T *input, T *output, std::size_t count, op o, std::size_t root) {
        detail::check(tutti_reduce(h_.get(), count, dtype_of<T>::value,
                                   static_cast<tutti_op>(o), root, input, output));
    }
    void barrier() { detail::check(tutti_barrier(h_.get())); }

    /// Block j of input goes to rank j, block k of output comes from rank k (`count`
    /// elements per block, world_size blocks in each; the buffers must not overlap).
    template <typename T> void all_to_all(const T *input, T *output, std::size_t count) {
        detail::check(tutti_all_to_all(h_.get(), count, dtype_of<T>::value, input, output));
    }
    /// `input` cut into world_size equal blocks; returns the blocks received, in rank order.
    template <typename T> std::vector<T> all_to_all(const std::vector<T> &input) {
        std::size_t p = world_size();
        if (input.size() % p != 0) {
            reject("tutti::comm::all_to_all: the input holds " +
                            std::to_string(input.size()) + " elements, not a whole number of "
                            "blocks for " + std::to_string(p) + " ranks");
        }
        std::vector<T> out(input.size());
        all_to_all(input.data(), out.data(), input.size() / p);
        return out;
    }
    /// send_counts[j] elements of input (in rank order) go to rank j; recv_counts[k] elements
    /// of output come from rank k. One count per rank in each (checked here: the C call reads
    /// world_size entries).
    template <typename T>
    void all_to_all_v(const T *input, const std::vector<std::size_t> &send_counts, T *output,
                      const std::vector<std::size_t> &recv_counts) {
        counts_total(send_counts, "all_to_all_v", "send_counts");
        counts_total(recv_counts, "all_to_all_v", "recv_counts");
        detail::check(tutti_all_to_all_v(h_.get(), send_counts.data(), recv_counts.data(),
                                         dtype_of<T>::value, input, output));
    }
    /// Returns the recv_counts' sum of elements received, in rank order.
    template <typename T>
    std::vector<T> all_to_all_v(const std::vector<T> &input,
                                const std::vector<std::size_t> &send_counts,
                                const std::vector<std::size_t> &recv_counts) {
        expect_len(input.size(), counts_total(send_counts, "all_to_all_v", "send_counts"),
                   "all_to_all_v", "the sum of send_counts");
        std::vector<T> out(counts_total(recv_counts, "all_to_all_v", "recv_counts"));
        all_to_all_v(input.data(), send_counts, out.data(), recv_counts);
        return out;
    }
    /// At the root, output (world_size × count) = every rank's input in rank order; elsewhere
    /// output may be null.
    template <typename T>
    void gather(const T *input, T *output, std::size_t count, std::size_t root) {
        detail::check(tutti_gather(h_.get(), count, dtype_of<T>::value, root, input, output));
    }
    /// Returns every rank's input in rank order at the root, an empty vector elsewhere.
    template <typename T> std::vector<T> gather(const std::vector<T> &input, std::size_t root) {
        std::vector<T> out(rank() == root ? checked_times(input.size(), "gather") : 0);
        gather(input.data(), out.empty() ? nullptr : out.data(), input.size(), root);
        return out;
    }
    /// output (count) = block `rank` of the root's input (world_size × count); input is used
    /// at the root only and may be null elsewhere.
    template <typename T>
    void scatter(const T *input, T *output, std::size_t count, std::size_t root) {
        detail::check(tutti_scatter(h_.get(), count, dtype_of<T>::value, root, input, output));
    }
    /// Returns this rank's block of the root's input (world_size × count elements there;
    /// ignored elsewhere).
    template <typename T>
    std::vector<T> scatter(const std::vector<T> &input, std::size_t count, std::size_t root) {
        bool at_root = rank() == root;
        if (at_root) {
            expect_len(input.size(), checked_times(count, "scatter"), "scatter",
                       "world_size × count at the root");
        }
        std::vector<T> out(count);
        scatter(at_root ? input.data() : nullptr, out.data(), count, root);
        return out;
    }
    /// output (the sum of counts) = every rank's input in rank order, rank r's counts[r]
    /// elements long; the same counts on every rank, one per rank.
    template <typename T>
    void all_gather_v(const T *input, T *output, const std::vector<std::size_t> &counts) {
        counts_total(counts, "all_gather_v", "counts");
        detail::check(
            tutti_all_gather_v(h_.get(), counts.data(), dtype_of<T>::value, input, output));
    }
    template <typename T>
    std::vector<T> all_gather_v(const std::vector<T> &input,
                                const std::vector<std::size_t> &counts) {
        std::vector<T> out(counts_total(counts, "all_gather_v", "counts"));
        expect_len(input.size(), counts[rank()], "all_gather_v", "counts[rank]");
        all_gather_v(input.data(), out.data(), counts);
        return out;
    }
    /// output (counts[rank]) = this rank's block of op over every rank's input (the sum of
    /// counts); the same counts on every rank, one per rank.
    template <typename T>
    void reduce_scatter_v(const T *input, T *output, const std::vector<std::size_t> &counts,
                          op o) {
        counts_total(counts, "reduce_scatter_v", "counts");
        detail::check(tutti_reduce_scatter_v(h_.get(), counts.data(), dtype_of<T>::value,
                                             static_cast<tutti_op>(o), input, output));
    }
    template <typename T>
    std::vector<T> reduce_scatter_v(const std::vector<T> &input,
                                    const std::vector<std::size_t> &counts, op o) {
        expect_len(input.size(), counts_total(counts, "reduce_scatter_v", "counts"),
                   "reduce_scatter_v", "the sum of counts");
        std::vector<T> out(counts[rank()]);
        reduce_scatter_v(input.data(), out.data(), counts, o);
        return out;
    }

    /// Point-to-point: send `count` elements to rank `peer`, which receives them with `recv`.
    /// Sends to a peer match its receives from this rank in issue order, with the same count
    /// and type (a receive of another count throws, naming both ranks, and aborts the group).
    /// Inside a `tutti::group` the call is recorded and runs at the group's end.
    template <typename T> void send(const T *buf, std::size_t count, std::size_t peer) {
        detail::check(tutti_send(h_.get(), count, dtype_of<T>::value, buf, peer));
    }
    template <typename T> void send(const std::vector<T> &buf, std::size_t peer) {
        send(buf.data(), buf.size(), peer);
    }
    /// Receive rank `peer`'s next send to this rank into `buf` (`count` elements).
    template <typename T> void recv(T *buf, std::size_t count, std::size_t peer) {
        detail::check(tutti_recv(h_.get(), count, dtype_of<T>::value, buf, peer));
    }
    /// Fills `buf`, whose size is the count received.
    template <typename T> void recv(std::vector<T> &buf, std::size_t peer) {
        recv(buf.data(), buf.size(), peer);
    }
    /// `send` without waiting (not inside a group); the buffer must outlive the call.
    template <typename T> work send_async(const T *buf, std::size_t count, std::size_t peer) {
        tutti_work *w = nullptr;
        detail::check(tutti_send_async(h_.get(), count, dtype_of<T>::value, buf, peer, &w));
        return work(w);
    }
    /// `recv` without waiting (not inside a group); the buffer must outlive the call.
    template <typename T> work recv_async(T *buf, std::size_t count, std::size_t peer) {
        tutti_work *w = nullptr;
        detail::check(tutti_recv_async(h_.get(), count, dtype_of<T>::value, buf, peer, &w));
        return work(w);
    }

    /// Non-blocking forms: the call is issued and runs in issue order; `work::wait` ends it.
    template <typename T>
    work all_reduce_async(const T *input, T *output, std::size_t count, op o) {
        tutti_work *w = nullptr;
        detail::check(tutti_all_reduce_async(h_.get(), count, dtype_of<T>::value,
                                             static_cast<tutti_op>(o), input, output, &w));
        return work(w);
    }
    template <typename T> work broadcast_async(T *buf, std::size_t count, std::size_t root) {
        tutti_work *w = nullptr;
        detail::check(tutti_broadcast_async(h_.get(), count, dtype_of<T>::value, root, buf, &w));
        return work(w);
    }
    template <typename T> work all_gather_async(const T *input, T *output, std::size_t count) {
        tutti_work *w = nullptr;
        detail::check(tutti_all_gather_async(h_.get(), count, dtype_of<T>::value, input, output, &w));
        return work(w);
    }
    template <typename T>
    work reduce_scatter_async(const T *input, T *output, std::size_t count, op o) {
        tutti_work *w = nullptr;
        detail::check(tutti_reduce_scatter_async(h_.get(), count, dtype_of<T>::value,
                                                 static_cast<tutti_op>(o), input, output, &w));
        return work(w);
    }
    template <typename T>
    work all_reduce_premul_sum_async(const T *input, T *output, std::size_t count, double factor) {
        tutti_work *w = nullptr;
        detail::check(tutti_all_reduce_premul_sum_async(h_.get(), count, dtype_of<T>::value,
                                                        factor, input, output, &w));
        return work(w);
    }
    template <typename T>
    work reduce_scatter_premul_sum_async(const T *input, T *output, std::size_t count,
                                         double factor) {
        tutti_work *w = nullptr;
        detail::check(tutti_reduce_scatter_premul_sum_async(h_.get(), count, dtype_of<T>::value,
                                                            factor, input, output, &w));
        return work(w);
    }
    template <typename T>
    work reduce_async(const T *input, T *output, std::size_t count, op o, std::size_t root) {
        tutti_work *w = nullptr;
        detail::check(tutti_reduce_async(h_.get(), count, dtype_of<T>::value,
                                         static_cast<tutti_op>(o), root, input, output, &w));
        return work(w);
    }
    template <typename T> work all_to_all_async(const T *input, T *output, std::size_t count) {
        tutti_work *w = nullptr;
        detail::check(
            tutti_all_to_all_async(h_.get(), count, dtype_of<T>::value, input, output, &w));
        return work(w);
    }
    /// The counts are copied when the call is issued; the buffers must outlive it.
    template <typename T>
    work all_to_all_v_async(const T *input, const std::vector<std::size_t> &send_counts,
                            T *output, const std::vector<std::size_t> &recv_counts) {
        counts_total(send_counts, "all_to_all_v_async", "send_counts");
        counts_total(recv_counts, "all_to_all_v_async", "recv_counts");
        tutti_work *w = nullptr;
        detail::check(tutti_all_to_all_v_async(h_.get(), send_counts.data(), recv_counts.data(),
                                               dtype_of<T>::value, input, output, &w));
        return work(w);
    }
    template <typename T>
    work gather_async(const T *input, T *output, std::size_t count, std::size_t root) {
        tutti_work *w = nullptr;
        detail::check(
            tutti_gather_async(h_.get(), count, dtype_of<T>::value, root, input, output, &w));
        return work(w);
    }
    template <typename T>
    work scatter_async(const T *input, T *output, std::size_t count, std::size_t root) {
        tutti_work *w = nullptr;
        detail::check(
            tutti_scatter_async(h_.get(), count, dtype_of<T>::value, root, input, output, &w));
        return work(w);
    }
    template <typename T>
    work all_gather_v_async(const T *input, T *output, const std::vector<std::size_t> &counts) {
        counts_total(counts, "all_gather_v_async", "counts");
        tutti_work *w = nullptr;
        detail::check(tutti_all_gather_v_async(h_.get(), counts.data(), dtype_of<T>::value, input,
                                               output, &w));
        return work(w);
    }
    template <typename T>
    work reduce_scatter_v_async(const T *input, T *output, const std::vector<std::size_t> &counts,
                                op o) {
        counts_total(counts, "reduce_scatter_v_async", "counts");
        tutti_work *w = nullptr;
        detail::check(tutti_reduce_scatter_v_async(h_.get(), counts.data(), dtype_of<T>::value,
                                                   static_cast<tutti_op>(o), input, output, &w));
        return work(w);
    }
    work barrier_async() {
        tutti_work *w = nullptr;
        detail::check(tutti_barrier_async(h_.get(), &w));
        return work(w);
    }

    /// `count` zeroed elements of T in shared memory (tutti_mem_alloc): collective, every rank
    /// with the same count, in the same order as its other calls.
    template <typename T> shared_array<T> alloc_shared(std::size_t count) {
        void *p = nullptr;
        if (count > SIZE_MAX / sizeof(T)) {
            throw error(TUTTI_ERROR_INVALID_ARGUMENT,
                        "tutti::comm::alloc_shared: count * sizeof(T) overflows size_t");
        }
        detail::check(tutti_mem_alloc(h_.get(), count * sizeof(T), &p));
        return shared_array<T>(h_, static_cast<T *>(p), count);
    }

    /// The C handle, still owned by this object (and by its shared arrays).
    tutti_comm *get() const noexcept { return h_.get(); }

private:
    /// The sum of `counts` (named `name` in calls to `fn`), which must hold one count per
    /// rank: the C calls read world_size entries.
    /// This rank's arguments are wrong before any C call: abort the group, so that the other
    /// ranks fail at once instead of waiting out the timeout (as the C calls do), and throw.
    [[noreturn]] void reject(const std::string &message) const {
        tutti_comm_abort(h_.get(), message.c_str());
        throw error(TUTTI_ERROR_INVALID_ARGUMENT,
                    message + " (the group is aborted so that the other ranks do not wait for "
                              "this call; create a new group)");
    }
    std::size_t counts_total(const std::vector<std::size_t> &counts, const char *fn,
                             const char *name) const {
        std::size_t p = world_size(), sum = 0;
        if (counts.size() != p) {
            reject(std::string("tutti::comm::") + fn + ": " + name + " has " +
                            std::to_string(counts.size()) + " entries for a world of " +
                            std::to_string(p) + " ranks; it needs one per rank");
        }
        for (std::size_t n : counts) {
            if (n > SIZE_MAX - sum) {
                reject(std::string("tutti::comm::") + fn +
                                                              ": the entries of " + name +
                                                              " sum past SIZE_MAX");
            }
            sum += n;
        }
        return sum;
    }
    /// world_size × n, or an error when it overflows.
    std::size_t checked_times(std::size_t n, const char *fn) const {
        std::size_t p = world_size();
        if (p != 0 && n > SIZE_MAX / p) {
            reject(std::string("tutti::comm::") + fn + ": world_size × " +
                            std::to_string(n) + " overflows size_t");
        }
        return n * p;
    }
    /// A vector's length must be what the call reads from it.
    void expect_len(std::size_t have, std::size_t want, const char *fn, const char *what) const {
        if (have != want) {
            reject(std::string("tutti::comm::") + fn + ": the input holds " +
                            std::to_string(have) + " elements but " + what + " is " +
                            std::to_string(want));
        }
    }

    /// Shared with the arrays from alloc_shared, which keep the communicator alive.
    std::shared_ptr<tutti_comm> h_;
};

/// Replicas driven by one caller that holds every replica's buffer. Move-only.
class replicas {
public:
    explicit replicas(std::size_t num_replicas, const config &cfg = config()) {
        tutti_replicas *r = nullptr;
        detail::check(tutti_replicas_create(num_replicas, cfg.get(), &r));
        h_.reset(r);
    }
    std::size_t size() const {
        std::size_t n = 0;
        detail::check(tutti_replicas_count(h_.get(), &n));
        return n;
    }
    /// Fail the running call and every later one; callable from any thread.
    void abort(const std::string &reason = std::string()) const {
        detail::check(tutti_replicas_abort(h_.get(), reason.empty() ? nullptr : reason.c_str()));
    }

    /// Every buffer becomes op over all of them. The buffers must be equally long.
    template <typename T> void all_reduce(std::vector<std::vector<T>> &bufs, op o) {
        std::vector<void *> p = pointers(bufs);
        detail::check(tutti_replicas_all_reduce(h_.get(), count_of(bufs), dtype_of<T>::value,
                                                static_cast<tutti_op>(o), p.size(), p.data()));
    }
    /// Every buffer becomes bufs[root].
    template <typename T> void broadcast(std::vector<std::vector<T>> &bufs, std::size_t root) {
        std::vector<void *> p = pointers(bufs);
        detail::check(tutti_replicas_broadcast(h_.get(), count_of(bufs), dtype_of<T>::value,
                                               root, p.size(), p.data()));
    }
    /// Each replica's output: every input, concatenated in replica order.
    template <typename T>
    std::vector<std::vector<T>> all_gather(const std::vector<std::vector<T>> &inputs) {
        std::size_t n = count_of(inputs);
        std::vector<std::vector<T>> outs(inputs.size(), std::vector<T>(n * inputs.size()));
        std::vector<const void *> in;
        for (const auto &b : inputs) {
            in.push_back(b.data());
        }
        std::vector<void *> out = pointers(outs);
        detail::check(tutti_replicas_all_gather(h_.get(), n, dtype_of<T>::value, in.size(),
                                                in.data(), out.data()));
        return outs;
    }
    /// op over every input, in one destination.
    template <typename T> std::vector<T> reduce(const std::vector<std::vector<T>> &inputs, op o) {
        std::size_t n = count_of(inputs);
        std::vector<T> out(n);
        std::vector<const void *> in;
        for (const auto &b : inputs) {
            in.push_back(b.data());
        }
        detail::check(tutti_replicas_reduce(h_.get(), n, dtype_of<T>::value,
                                            static_cast<tutti_op>(o), in.size(), in.data(),
                                            out.data()));
        return out;
    }

    tutti_replicas *get() const noexcept { return h_.get(); }

private:
    template <typename T> static std::vector<void *> pointers(std::vector<std::vector<T>> &bufs) {
        std::vector<void *> p;
        for (auto &b : bufs) {
            p.push_back(b.data());
        }
        return p;
    }
    template <typename T> static std::size_t count_of(const std::vector<std::vector<T>> &bufs) {
        if (bufs.empty()) {
            return 0;
        }
        for (const auto &b : bufs) {
            if (b.size() != bufs[0].size()) {
                throw error(TUTTI_ERROR_INVALID_ARGUMENT,
                            "tutti::replicas: the buffers differ in length; every replica's "
                            "buffer must hold the same number of elements");
            }
        }
        return bufs[0].size();
    }

    std::unique_ptr<tutti_replicas, detail::replicas_deleter> h_;
};

// ----- tf.distribute strategies (tutti_strategy), checkpoints, parameter servers -----

/// A strategy's kind (TensorFlow's strategies).
enum class strategy_kind : std::uint32_t {
    default_strategy = TUTTI_STRATEGY_DEFAULT,
    one_device = TUTTI_STRATEGY_ONE_DEVICE,
    mirrored = TUTTI_STRATEGY_MIRRORED,
    central_storage = TUTTI_STRATEGY_CENTRAL_STORAGE,
    multi_worker_mirrored = TUTTI_STRATEGY_MULTI_WORKER_MIRRORED,
    /// TPUStrategy: a replica per device of this host's TPU, or of the PJRT plugin
    /// TUTTI_PJRT_PLUGIN names (see initialize_tpu_system).
    tpu = TUTTI_STRATEGY_TPU,
};

/// The topology initialize_tpu_system reports.
struct tpu_topology {
    std::size_t num_cores = 0;
    std::size_t num_tasks = 0;
    std::size_t num_cores_per_task = 0;
};

/// TensorFlow's initialize_tpu_system: open this host's TPU through its PJRT plugin (else the
/// plugin TUTTI_PJRT_PLUGIN names, with TUTTI_PJRT_OPTIONS) and report its topology; then
/// `tutti::strategy(tutti::strategy_kind::tpu)` puts a replica on each core. Initializing
/// again warns that it loses what the devices hold. Throws tutti::error
/// (TUTTI_ERROR_UNAVAILABLE) without a plugin, or with a libtutti built without XLA.
inline tpu_topology initialize_tpu_system() {
    tpu_topology t;
    detail::check(tutti_tpu_initialize(&t.num_cores, &t.num_tasks, &t.num_cores_per_task));
    return t;
}

/// How a mirrored strategy combines its replicas' values (TensorFlow's cross-device ops).
enum class cross_device_ops : std::uint32_t {
    default_ops = TUTTI_CROSS_DEVICE_OPS_DEFAULT,
    nccl_all_reduce = TUTTI_CROSS_DEVICE_OPS_NCCL_ALL_REDUCE,
    hierarchical_copy = TUTTI_CROSS_DEVICE_OPS_HIERARCHICAL_COPY,
    reduction_to_one_device = TUTTI_CROSS_DEVICE_OPS_REDUCTION_TO_ONE_DEVICE,
    ring = TUTTI_CROSS_DEVICE_OPS_RING,
};

namespace detail {
struct strategy_deleter {
    void operator()(tutti_strategy *s) const noexcept { tutti_strategy_destroy(s); }
};
struct checkpoint_deleter {
    void operator()(tutti_checkpoint *c) const noexcept { tutti_checkpoint_destroy(c); }
};
struct variable_deleter {
    void operator()(tutti_variable *v) const noexcept { tutti_variable_destroy(v); }
};
struct tensor_deleter {
    void operator()(tutti_tensor *t) const noexcept { tutti_tensor_destroy(t); }
};
struct device_variable_deleter {
    void operator()(tutti_device_variable *v) const noexcept {
        tutti_device_variable_destroy(v);
    }
};
struct ps_strategy_deleter {
    void operator()(tutti_ps_strategy *s) const noexcept { tutti_ps_strategy_destroy(s); }
};
struct ps_coordinator_deleter {
    void operator()(tutti_ps_coordinator *c) const noexcept { tutti_ps_coordinator_destroy(c); }
};
struct ps_remote_value_deleter {
    void operator()(tutti_ps_remote_value *v) const noexcept { tutti_ps_remote_value_destroy(v); }
};

/// The exception to rethrow of those the replicas' functions threw: the first that is not a
/// tutti::error (a sibling woken by a failure throws one), else the first.
inline std::exception_ptr first_own(const std::vector<std::exception_ptr> &errors) {
    std::exception_ptr any;
    for (const auto &e : errors) {
        if (!e) {
            continue;
        }
        try {
            std::rethrow_exception(e);
        } catch (const error &) {
            if (!any) {
                any = e;
            }
        } catch (...) {
            return e;
        }
    }
    return any;
}
} // namespace detail

/// A value in a replica's device memory (tutti_tensor; a PJRT buffer under TPUStrategy, host
/// memory for CPU replicas), made by replica_context::place. Move-only.
template <typename T> class tensor {
public:
    /// A tensor in host memory holding `data` (tutti_tensor_from_host).
    static tensor from_host(const std::vector<T> &data) {
        tutti_tensor *t = nullptr;
        detail::check(tutti_tensor_from_host(data.size(), dtype_of<T>::value, data.data(), &t));
        return tensor(t);
    }
    /// Its number of elements.
    std::size_t size() const {
        std::size_t n = 0;
        detail::check(tutti_tensor_info(h_.get(), nullptr, &n, nullptr));
        return n;
    }
    /// Its elements, copied to the host.
    std::vector<T> read() const {
        std::vector<T> out(size());
        detail::check(tutti_tensor_read(h_.get(), out.size(), dtype_of<T>::value, out.data()));
        return out;
    }
    tutti_tensor *get() const noexcept { return h_.get(); }

private:
    friend class replica_context;
    friend class strategy;
    explicit tensor(tutti_tensor *t) : h_(t) {}
    std::unique_ptr<tutti_tensor, detail::tensor_deleter> h_;
};

/// What a replica function gets: its ids and the collectives across every replica in sync.
/// Valid only during that call, on that thread.
class replica_context {
public:
    /// This replica's index among every replica in sync (TensorFlow's replica_id_in_sync_group).
    std::size_t replica_id() const {
        std::size_t id = 0;
        detail::check(tutti_replica_id(c_, &id, nullptr));
        return id;
    }
    /// This replica's index on this process.
    std::size_t local_replica_id() const {
        std::size_t id = 0;
        detail::check(tutti_replica_id(c_, nullptr, &id));
        return id;
    }
    /// buf becomes op over every replica's buf.
    template <typename T> void all_reduce(std::vector<T> &buf, op o) const {
        detail::check(tutti_replica_all_reduce(c_, buf.size(), dtype_of<T>::value,
                                               static_cast<tutti_op>(o), buf.data()));
    }
    /// buf becomes replica root's buf.
    template <typename T> void broadcast(std::vector<T> &buf, std::size_t root) const {
        detail::check(
            tutti_replica_broadcast(c_, buf.size(), dtype_of<T>::value, root, buf.data()));
    }
    /// `data` placed on this replica's device (tutti_replica_place).
    template <typename T> tensor<T> place(const std::vector<T> &data) const {
        tutti_tensor *t = nullptr;
        detail::check(tutti_replica_place(c_, data.size(), dtype_of<T>::value, data.data(), &t));
        return tensor<T>(t);
    }
    /// t becomes op over every replica's t, where they lie.
    template <typename T> void all_reduce(tensor<T> &t, op o) const {
        detail::check(tutti_replica_all_reduce_tensor(c_, static_cast<tutti_op>(o), t.get()));
    }
    /// t becomes replica root's t, where they lie.
    template <typename T> void broadcast(tensor<T> &t, std::size_t root) const {
        detail::check(tutti_replica_broadcast_tensor(c_, root, t.get()));
    }
    /// t becomes every replica's t in replica order, where they lie.
    template <typename T> void all_gather(tensor<T> &t) const {
        detail::check(tutti_replica_all_gather_tensor(c_, t.get()));
    }
    const tutti_replica_context *get() const noexcept { return c_; }

private:
    friend class strategy;
    explicit replica_context(const tutti_replica_context *c) : c_(c) {}
    const tutti_replica_context *c_;
};

/// The collectives a multi-worker strategy runs across workers (CommunicationImplementation).
enum class communication : std::uint32_t {
    automatic = TUTTI_COMMUNICATION_AUTO,
    ring = TUTTI_COMMUNICATION_RING,
    nccl = TUTTI_COMMUNICATION_NCCL,
};

/// A tf.distribute strategy (tutti_strategy). Move-only.
///
///     tutti::strategy s(tutti::strategy_kind::mirrored, 4);
///     s.run([&](const tutti::replica_context &ctx) { ctx.all_reduce(grad[ctx.local_replica_id()], tutti::op::sum); });
class strategy {
public:
    /// `num_local_replicas` logical CPU devices (0: every GPU, else the CPU);
    /// multi_worker_mirrored joins the job its environment describes.
    explicit strategy(strategy_kind kind, std::size_t num_local_replicas = 0,
                      cross_device_ops ops = cross_device_ops::default_ops) {
        tutti_strategy *s = nullptr;
        detail::check(tutti_strategy_create(static_cast<tutti_strategy_kind>(kind),
                                            num_local_replicas,
                                            static_cast<tutti_cross_device_ops>(ops), &s));
        h_.reset(s);
    }
    /// A MirroredStrategy whose replicas combine their values as `ops` says (hierarchical
    /// copy's num_packs and group_size, reduce_to_device, or a CUSTOM op of the caller's, whose
    /// function and data must outlive the strategy).
    strategy(std::size_t num_local_replicas, const tutti_cross_device_ops_config &ops) {
        tutti_strategy *s = nullptr;
        detail::check(tutti_strategy_create_mirrored(num_local_replicas, &ops, &s));
        h_.reset(s);
    }
    /// Replicas on the devices named (`"cpu:0"`, `"gpu:1"`, `"xla:0"`, TensorFlow's
    /// `"/device:GPU:0"`): one_device (one device), mirrored (combining as `ops` says; nullptr:
    /// as TensorFlow chooses), central_storage, multi_worker_mirrored (each worker's local
    /// devices). On XLA devices the replicas reduce there.
    strategy(strategy_kind kind, const std::vector<std::string> &devices,
             const tutti_cross_device_ops_config *ops = nullptr) {
        std::vector<const char *> names;
        names.reserve(devices.size());
        for (const auto &d : devices) {
            names.push_back(d.c_str());
        }
        tutti_strategy *s = nullptr;
        detail::check(tutti_strategy_create_on_devices(static_cast<tutti_strategy_kind>(kind),
                                                       names.data(), names.size(), ops, &s));
        h_.reset(s);
    }
    /// A MultiWorkerMirroredStrategy: `num_local_replicas` logical CPU devices (0: every GPU,
    /// else the CPU) on every worker of the cluster `tf_config` describes (nullptr: the
    /// environment's), its collectives across workers as `c` says, batch reduces fused in
    /// packs of `bytes_per_pack` (0: tutti's default) and every wait (the workers' joining
    /// too) bounded by `timeout` (0: the configured one, TUTTI_TIMEOUT): TensorFlow's
    /// CommunicationOptions.
    static strategy multi_worker(communication c = communication::automatic,
                                 const char *tf_config = nullptr,
                                 std::size_t num_local_replicas = 0,
                                 std::size_t bytes_per_pack = 0,
                                 std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) {
        if (timeout.count() < 0) {
            throw std::invalid_argument("multi_worker: a negative timeout (0: the configured one)");
        }
        tutti_strategy *s = nullptr;
        detail::check(tutti_strategy_create_multi_worker_with_options(
            tf_config, static_cast<tutti_communication>(c), bytes_per_pack,
            static_cast<std::uint64_t>(timeout.count()), num_local_replicas, &s));
        return strategy(s);
    }
    /// multi_worker with every worker's local replicas on the devices named (`"cpu:0"`,
    /// `"gpu:1"`, `"xla:0"`, TensorFlow's `"/device:GPU:0"`); on XLA devices each worker's
    /// replicas reduce there first.
    static strategy multi_worker(const std::vector<std::string> &devices,
                                 communication c = communication::automatic,
                                 const char *tf_config = nullptr,
                                 std::size_t bytes_per_pack = 0,
                                 std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) {
        if (timeout.count() < 0) {
            throw std::invalid_argument("multi_worker: a negative timeout (0: the configured one)");
        }
        std::vector<const char *> names;
        names.reserve(devices.size());
        for (const auto &d : devices) {
            names.push_back(d.c_str());
        }
        tutti_strategy *s = nullptr;
        detail::check(tutti_strategy_create_multi_worker_on_devices(
            tf_config, static_cast<tutti_communication>(c), bytes_per_pack,
            static_cast<std::uint64_t>(timeout.count()), names.data(), names.size(), &s));
        return strategy(s);
    }
    /// Replicas in sync across the job (TensorFlow's num_replicas_in_sync).
    std::size_t num_replicas_in_sync() const {
        std::size_t n = 0;
        detail::check(tutti_strategy_num_replicas(h_.get(), &n, nullptr));
        return n;
    }
    /// Replicas on this process.
    std::size_t num_local_replicas() const {
        std::size_t n = 0;
        detail::check(tutti_strategy_num_replicas(h_.get(), nullptr, &n));
        return n;
    }
    /// `data` placed on local replica `local_replica`'s device from outside run, from any
    /// thread (tutti_strategy_place): an input pipeline's next batch.
    template <typename T>
    tensor<T> place_on_replica(std::size_t local_replica, const std::vector<T> &data) const {
        tutti_tensor *t = nullptr;
        detail::check(tutti_strategy_place(h_.get(), local_replica, data.size(),
                                           dtype_of<T>::value, data.data(), &t));
        return tensor<T>(t);
    }
    /// fn(const replica_context &) once per local replica, in parallel. An exception fn throws
    /// is rethrown here (the replica's own, rather than a sibling's woken by it); the strategy
    /// stays usable.
    template <typename F> void run(F &&fn) {
        struct call {
            std::remove_reference_t<F> *fn;
            std::vector<std::exception_ptr> errors;
        } c{&fn, std::vector<std::exception_ptr>(num_local_replicas())};
        tutti_result r = tutti_strategy_run(
            h_.get(),
            [](const tutti_replica_context *ctx, void *user) -> tutti_result {
                auto *c = static_cast<call *>(user);
                std::size_t local = 0;
                if (tutti_replica_id(ctx, nullptr, &local) != TUTTI_SUCCESS ||
                    local >= c->errors.size()) {
                    return TUTTI_ERROR_INTERNAL;
                }
                try {
                    (*c->fn)(replica_context(ctx));
                    return TUTTI_SUCCESS;
                } catch (const std::exception &e) {
                    c->errors[local] = std::current_exception();
                    // What the run's error says (and, across workers, what the others hear).
                    tutti_replica_set_error(ctx, e.what());
                    return TUTTI_ERROR_SYSTEM;
                } catch (...) {
                    c->errors[local] = std::current_exception();
                    return TUTTI_ERROR_SYSTEM;
                }
            },
            &c);
        if (std::exception_ptr e = detail::first_own(c.errors)) {
            std::rethrow_exception(e);
        }
        detail::check(r);
    }
    /// MultiWorkerMirroredStrategy: go on after a worker was lost, or after a rejection or a
    /// mismatch ended the workers' communicator (tutti_strategy_shrink): every surviving worker
    /// calls it, outside any scope of this strategy.
    void shrink() { detail::check(tutti_strategy_shrink(h_.get())); }
    /// op (sum or mean) of one value per local replica, across every replica in sync
    /// (TensorFlow's strategy.reduce with no axis). The values must be equally long.
    template <typename T> std::vector<T> reduce(const std::vector<std::vector<T>> &per_replica, op o) {
        std::vector<const void *> in;
        for (const auto &v : per_replica) {
            if (v.size() != per_replica.at(0).size()) {
                throw error(TUTTI_ERROR_INVALID_ARGUMENT,
                            "tutti::strategy::reduce: the replicas' values differ in length");
            }
            in.push_back(v.data());
        }
        std::vector<T> out(per_replica.empty() ? 0 : per_replica[0].size());
        detail::check(tutti_strategy_reduce(h_.get(), out.size(), dtype_of<T>::value,
                                            static_cast<tutti_op>(o),
                                            in.empty() ? nullptr : in.data(), out.data()));
        return out;
    }
    /// The rows of every replica in sync, in replica order across the job (TensorFlow's
    /// strategy.gather along axis 0): local replica i gives per_replica[i], whole rows of
    /// `row_len` elements; `max_rows` bounds the rows of the whole job (a global batch's, say).
    template <typename T>
    std::vector<T> gather(const std::vector<std::vector<T>> &per_replica, std::size_t row_len,
                          std::size_t max_rows) {
        std::vector<const void *> in;
        std::vector<std::size_t> rows;
        for (const auto &v : per_replica) {
            if (row_len == 0 || v.size() % row_len != 0) {
                throw error(TUTTI_ERROR_INVALID_ARGUMENT,
                            "tutti::strategy::gather: a replica's value is not whole rows");
            }
            in.push_back(v.data());
            rows.push_back(v.size() / row_len);
        }
        std::vector<T> out(max_rows * row_len);
        std::size_t total = 0;
        detail::check(tutti_strategy_gather(h_.get(), dtype_of<T>::value, row_len,
                                            in.empty() ? nullptr : in.data(),
                                            rows.empty() ? nullptr : rows.data(), out.data(),
                                            max_rows, &total));
        out.resize(total * row_len);
        return out;
    }
    /// The rows [first, second) of a global batch of `rows` rows each local replica takes.
    std::vector<std::pair<std::size_t, std::size_t>> batch_rows(std::size_t rows) const {
        std::vector<std::size_t> starts(num_local_replicas() + 1);
        detail::check(tutti_strategy_batch_rows(h_.get(), rows, starts.data(), starts.size()));
        std::vector<std::pair<std::size_t, std::size_t>> out;
        for (std::size_t i = 0; i + 1 < starts.size(); i++) {
            out.emplace_back(starts[i], starts[i + 1]);
        }
        return out;
    }
    /// This process's place in the job (TensorFlow's strategy.cluster_resolver).
    struct cluster_info {
        std::string task_type;
        std::size_t task_id;
        std::size_t num_workers;
        bool is_chief;
    };
    cluster_info cluster() const {
        char type[64] = {0};
        cluster_info info{std::string(), 0, 0, false};
        detail::check(tutti_strategy_cluster(h_.get(), type, sizeof type, &info.task_id,
                                             &info.num_workers, &info.is_chief));
        info.task_type = type;
        return info;
    }
    tutti_strategy *get() const noexcept { return h_.get(); }

    /// This strategy's scope on this thread (TensorFlow's `with strategy.scope():`), until the
    /// guard is destroyed: tutti::variable made meanwhile is this strategy's kind.
    class scope_guard {
    public:
        scope_guard(const scope_guard &) = delete;
        scope_guard &operator=(const scope_guard &) = delete;
        ~scope_guard() { tutti_strategy_scope_end(s_); }

    private:
        friend class strategy;
        explicit scope_guard(tutti_strategy *s) : s_(s) {
            detail::check(tutti_strategy_scope_begin(s_));
        }
        tutti_strategy *s_;
    };
    /// Enter the scope (an error inside another strategy's scope). Not on a temporary: the
    /// strategy must outlive its scope.
    scope_guard scope() const & { return scope_guard(h_.get()); }
    scope_guard scope() const && = delete;

private:
    explicit strategy(tutti_strategy *s) : h_(s) {}
    std::unique_ptr<tutti_strategy, detail::strategy_deleter> h_;
};

/// How the replicas' updates of a variable combine (TensorFlow's VariableAggregation).
enum class aggregation : std::uint32_t {
    only_first_replica = TUTTI_AGGREGATION_ONLY_FIRST_REPLICA,
    sum = TUTTI_AGGREGATION_SUM,
    mean = TUTTI_AGGREGATION_MEAN,
};

/// A variable (tutti_variable; TensorFlow's tf.Variable): made inside a strategy's scope, that
/// strategy's kind (a copy per replica, one under CentralStorageStrategy, shards on the ps
/// tasks in a ps_coordinator's scope) with the chief's initial value; outside any scope, one
/// plain copy. Move-only.
template <typename T> class variable {
public:
    explicit variable(const std::vector<T> &initial,
                      aggregation agg = aggregation::only_first_replica)
        : n_(initial.size()) {
        tutti_variable *v = nullptr;
        detail::check(tutti_variable_create(dtype_of<T>::value, initial.size(), initial.data(),
                                            static_cast<tutti_aggregation>(agg), &v));
        h_.reset(v);
    }
    /// The value (outside strategy::run).
    std::vector<T> value() const {
        std::vector<T> out(n_);
        detail::check(tutti_variable_read(h_.get(), nullptr, dtype_of<T>::value, n_, out.data()));
        return out;
    }
    /// The copy of the replica running `ctx`.
    std::vector<T> read(const replica_context &ctx) const {
        std::vector<T> out(n_);
        detail::check(
            tutti_variable_read(h_.get(), ctx.get(), dtype_of<T>::value, n_, out.data()));
        return out;
    }
    /// From outside run: combine one update per local replica by the variable's aggregation
    /// and add it (assign_sub, assign alike).
    void assign_add(strategy &s, const std::vector<std::vector<T>> &per_replica) {
        update(s, TUTTI_ASSIGN_ADD, per_replica);
    }
    void assign_sub(strategy &s, const std::vector<std::vector<T>> &per_replica) {
        update(s, TUTTI_ASSIGN_SUB, per_replica);
    }
    void assign(strategy &s, const std::vector<std::vector<T>> &per_replica) {
        update(s, TUTTI_ASSIGN, per_replica);
    }
    /// A variable made in a ps_coordinator's scope, on the chief: set it on the ps tasks, or
    /// step it there by `delta` as the workers' steps do (assign_add, assign_sub).
    void assign(const std::vector<T> &value) { update_ps(TUTTI_ASSIGN, value); }
    void assign_add(const std::vector<T> &delta) { update_ps(TUTTI_ASSIGN_ADD, delta); }
    void assign_sub(const std::vector<T> &delta) { update_ps(TUTTI_ASSIGN_SUB, delta); }
    /// Its index among the parameter-server job's variables (what a step reads it by), where
    /// it was made in a ps_coordinator's scope.
    std::size_t ps_index() const {
        std::size_t i = 0;
        detail::check(tutti_variable_ps_index(h_.get(), &i));
        return i;
    }
    tutti_variable *get() const noexcept { return h_.get(); }

private:
    void update_ps(tutti_assign how, const std::vector<T> &value) {
        const void *in = value.data();
        detail::check(
            tutti_variable_update(nullptr, h_.get(), how, dtype_of<T>::value, value.size(), &in));
    }
    void update(strategy &s, tutti_assign how, const std::vector<std::vector<T>> &per_replica) {
        std::vector<const void *> in;
        for (const auto &v : per_replica) {
            if (v.size() != n_) {
                throw error(TUTTI_ERROR_INVALID_ARGUMENT,
                            "tutti::variable: an update of another length than the variable");
            }
            in.push_back(v.data());
        }
        if (in.size() != s.num_local_replicas()) {
            throw error(TUTTI_ERROR_INVALID_ARGUMENT,
                        "tutti::variable: one update per local replica");
        }
        detail::check(tutti_variable_update(s.get(), h_.get(), how, dtype_of<T>::value, n_,
                                            in.empty() ? nullptr : in.data()));
    }
    std::size_t n_;
    std::unique_ptr<tutti_variable, detail::variable_deleter> h_;
};

/// A mirrored variable whose copies live in the replicas' device memory
/// (tutti_device_variable; PJRT buffers under TPUStrategy, host memory for CPU replicas),
/// starting from the chief's `initial`. Move-only.
///
///     tutti::device_variable<float> w(s, {0, 0});
///     s.run([&](const tutti::replica_context &ctx) {
///         auto g = ctx.place(grad[ctx.local_replica_id()]);
///         w.assign_sub(ctx, g, tutti::aggregation::mean);
///     });
template <typename T> class device_variable {
public:
    device_variable(const strategy &s, const std::vector<T> &initial) : n_(initial.size()) {
        tutti_device_variable *v = nullptr;
        detail::check(tutti_strategy_device_variable(s.get(), initial.size(), dtype_of<T>::value,
                                                     initial.data(), &v));
        h_.reset(v);
    }
    /// Elements in each copy.
    std::size_t size() const noexcept { return n_; }
    /// Local replica `replica`'s copy, copied to the host.
    std::vector<T> read(std::size_t replica) const {
        std::vector<T> out(n_);
        detail::check(
            tutti_device_variable_read(h_.get(), replica, n_, dtype_of<T>::value, out.data()));
        return out;
    }
    /// The value (every copy holds it outside strategy::run).
    std::vector<T> value() const { return read(0); }
    /// Inside run: every replica's `update` (on its device) combined by `agg` and added to
    /// every copy, where they lie (assign_sub, assign alike).
    void assign_add(const replica_context &ctx, const tensor<T> &update, aggregation agg) {
        update_in(ctx, TUTTI_ASSIGN_ADD, update, agg);
    }
    void assign_sub(const replica_context &ctx, const tensor<T> &update, aggregation agg) {
        update_in(ctx, TUTTI_ASSIGN_SUB, update, agg);
    }
    void assign(const replica_context &ctx, const tensor<T> &value, aggregation agg) {
        update_in(ctx, TUTTI_ASSIGN, value, agg);
    }
    tutti_device_variable *get() const noexcept { return h_.get(); }

private:
    void update_in(const replica_context &ctx, tutti_assign how, const tensor<T> &t,
                   aggregation agg) {
        detail::check(tutti_device_variable_update_in(ctx.get(), h_.get(), how,
                                                      static_cast<tutti_aggregation>(agg),
                                                      t.get()));
    }
    std::size_t n_;
    std::unique_ptr<tutti_device_variable, detail::device_variable_deleter> h_;
};

/// A step and named tensors, saved to and restored from a directory in tutti's checkpoint
/// format (tutti_checkpoint; TensorFlow's tf.train.Checkpoint and CheckpointManager).
class checkpoint {
public:
    explicit checkpoint(std::uint64_t step) {
        tutti_checkpoint *c = nullptr;
        detail::check(tutti_checkpoint_create(step, &c));
        h_.reset(c);
    }
    /// The steps trained when it was made.
    std::uint64_t step() const {
        std::uint64_t s = 0;
        detail::check(tutti_checkpoint_step(h_.get(), &s));
        return s;
    }
    /// Add (a copy of) the tensor `name` of `shape` at `data`.
    template <typename T>
    void insert(const std::string &name, const std::vector<std::size_t> &shape, const T *data) {
        detail::check(tutti_checkpoint_insert(h_.get(), name.c_str(), dtype_of<T>::value,
                                              shape.size(), shape.data(), data));
    }
    /// Add (a copy of) the vector `name`.
    template <typename T> void insert(const std::string &name, const std::vector<T> &data) {
        insert(name, std::vector<std::size_t>{data.size()}, data.data());
    }
    /// The shape of tensor `name` (an error naming what the checkpoint holds when absent).
    std::vector<std::size_t> shape(const std::string &name) const {
        tutti_dtype d;
        std::size_t ndim = 0;
        std::vector<std::size_t> dims(64);
        detail::check(tutti_checkpoint_variable(h_.get(), name.c_str(), &d, &ndim, dims.data(),
                                                dims.size()));
        dims.resize(ndim);
        return dims;
    }
    /// The values of tensor `name`, of element type T (an error if it holds another).
    template <typename T> std::vector<T> read(const std::string &name) const {
        std::size_t n = 1;
        for (std::size_t d : shape(name)) {
            n *= d;
        }
        std::vector<T> out(n);
        detail::check(
            tutti_checkpoint_read(h_.get(), name.c_str(), dtype_of<T>::value, n, out.data()));
        return out;
    }
    /// Save into `directory` as ckpt-STEP.tutti, keeping the last `max_to_keep` (0: all). With
    /// a multi-worker strategy the chief writes and every worker learns the outcome.
    void save(const std::string &directory, std::size_t max_to_keep,
              const strategy *s = nullptr) const {
        detail::check(tutti_checkpoint_save(s ? s->get() : nullptr, directory.c_str(),
                                            max_to_keep, h_.get()));
    }
    /// The latest checkpoint in `directory`, or none where there is none.
    static std::unique_ptr<checkpoint> restore(const std::string &directory,
                                               const strategy *s = nullptr) {
        tutti_checkpoint *c = nullptr;
        detail::check(tutti_checkpoint_restore(s ? s->get() : nullptr, directory.c_str(), &c));
        if (!c) {
            return nullptr;
        }
        return std::unique_ptr<checkpoint>(new checkpoint(c));
    }
    tutti_checkpoint *get() const noexcept { return h_.get(); }

private:
    explicit checkpoint(tutti_checkpoint *c) : h_(c) {}
    std::unique_ptr<tutti_checkpoint, detail::checkpoint_deleter> h_;
};

/// How variables are cut into shards across the ps tasks (TensorFlow's partitioners).
enum class partitioner : std::uint32_t {
    max_shards = TUTTI_PARTITIONER_MAX_SHARDS,
    fixed_shards = TUTTI_PARTITIONER_FIXED_SHARDS,
    min_shard_bytes = TUTTI_PARTITIONER_MIN_SHARD_BYTES,
    max_shard_bytes = TUTTI_PARTITIONER_MAX_SHARD_BYTES,
};

/// How the ps tasks step a variable by a gradient (tutti_ps_update): plain SGD at 0.01 unless
/// set otherwise.
struct ps_update {
    tutti_ps_update u = TUTTI_PS_UPDATE_INIT;
    /// SGD at `learning_rate`, with `momentum` (0: none), Nesterov's if `nesterov`.
    static ps_update sgd(float learning_rate, float momentum = 0.0f, bool nesterov = false,
                         std::uint64_t slots = 0) {
        ps_update p;
        p.u.rule = TUTTI_PS_RULE_SGD;
        p.u.learning_rate = learning_rate;
        p.u.momentum = momentum;
        p.u.nesterov = nesterov ? 1u : 0u;
        p.u.slots = slots;
        return p;
    }
    /// Adam at `learning_rate` (Keras's other defaults).
    static ps_update adam(float learning_rate, float beta_1 = 0.9f, float beta_2 = 0.999f,
                          float epsilon = 1e-7f, std::uint64_t slots = 0) {
        ps_update p;
        p.u.rule = TUTTI_PS_RULE_ADAM;
        p.u.learning_rate = learning_rate;
        p.u.beta_1 = beta_1;
        p.u.beta_2 = beta_2;
        p.u.epsilon = epsilon;
        p.u.slots = slots;
        return p;
    }
};

namespace detail {
struct optimizer_deleter {
    void operator()(tutti_optimizer *o) const noexcept { tutti_optimizer_destroy(o); }
};
} // namespace detail

/// An optimizer for device variables (tutti_optimizer): Keras's SGD, momentum, Nesterov or
/// Adam, given as a ps_update (its slots key unused). Move-only.
///
///     tutti::optimizer opt(tutti::ps_update::adam(0.001f));
///     s.run([&](const tutti::replica_context &ctx) {
///         auto g = ctx.place(grad[ctx.local_replica_id()]);
///         opt.apply_gradients(ctx, g, w);
///     });
class optimizer {
public:
    explicit optimizer(const ps_update &rule) {
        tutti_optimizer *o = nullptr;
        detail::check(tutti_optimizer_create(&rule.u, &o));
        h_.reset(o);
    }
    /// Steps taken.
    std::uint64_t iterations() const {
        std::uint64_t n = 0;
        detail::check(tutti_optimizer_iterations(h_.get(), &n));
        return n;
    }
    /// The learning rate the next step takes.
    float learning_rate() const {
        float lr = 0;
        detail::check(tutti_optimizer_learning_rate(h_.get(), &lr));
        return lr;
    }
    /// Step at `lr` from the next step on (a schedule: set it before each step), between
    /// steps, alike on every worker.
    void set_learning_rate(float lr) {
        detail::check(tutti_optimizer_set_learning_rate(h_.get(), lr));
    }
    /// Inside run: `grad` summed in place across every replica, then this replica's copy of
    /// `var` stepped by it on its device.
    template <typename T>
    void apply_gradients(const replica_context &ctx, tensor<T> &grad,
                         const device_variable<T> &var) {
        apply_gradients<T>(ctx, {{&grad, &var}});
    }
    /// The same for several variables of one dtype: one step (one count in iterations()).
    template <typename T>
    void apply_gradients(
        const replica_context &ctx,
        const std::vector<std::pair<tensor<T> *, const device_variable<T> *>> &grads_and_vars) {
        std::vector<tutti_tensor *> g;
        std::vector<const tutti_device_variable *> v;
        for (const auto &p : grads_and_vars) {
            g.push_back(p.first->get());
            v.push_back(p.second->get());
        }
        detail::check(tutti_optimizer_apply_device_gradients(ctx.get(), h_.get(), g.size(),
                                                             g.data(), v.data()));
    }
    /// Its state of `vars` (named as in the checkpoint) added to `ckpt` under `name`.
    template <typename T>
    void save(checkpoint &ckpt, const std::string &name,
              const std::vector<std::pair<std::string, const device_variable<T> *>> &vars) const {
        named(vars, [&](const char *const *n, const tutti_device_variable *const *v) {
            detail::check(tutti_optimizer_save(h_.get(), ckpt.get(), name.c_str(), vars.size(),
                                               n, v));
        });
    }
    /// Its state of `vars` taken back from `ckpt`.
    template <typename T>
    void restore(const checkpoint &ckpt, const std::string &name,
                 const std::vector<std::pair<std::string, const device_variable<T> *>> &vars) {
        named(vars, [&](const char *const *n, const tutti_device_variable *const *v) {
            detail::check(tutti_optimizer_restore(h_.get(), ckpt.get(), name.c_str(), vars.size(),
                                                  n, v));
        });
    }
    tutti_optimizer *get() const noexcept { return h_.get(); }

private:
    template <typename T, typename F>
    static void named(const std::vector<std::pair<std::string, const device_variable<T> *>> &vars,
                      F f) {
        std::vector<const char *> n;
        std::vector<const tutti_device_variable *> v;
        for (const auto &p : vars) {
            n.push_back(p.first.c_str());
            v.push_back(p.second->get());
        }
        f(n.data(), v.data());
    }
    std::unique_ptr<tutti_optimizer, detail::optimizer_deleter> h_;
};

/// What a parameter-server step function gets on a worker: valid only during that call.
class ps_step {
public:
    std::uint64_t step() const {
        std::uint64_t s = 0;
        detail::check(tutti_ps_step_info(s_, &s, nullptr, nullptr, nullptr));
        return s;
    }
    std::size_t worker() const {
        std::size_t w = 0;
        detail::check(tutti_ps_step_info(s_, nullptr, &w, nullptr, nullptr));
        return w;
    }
    std::size_t num_workers() const {
        std::size_t n = 0;
        detail::check(tutti_ps_step_info(s_, nullptr, nullptr, &n, nullptr));
        return n;
    }
    std::size_t num_variables() const {
        std::size_t n = 0;
        detail::check(tutti_ps_step_info(s_, nullptr, nullptr, nullptr, &n));
        return n;
    }
    /// Variable `index` as pulled for this step (T: its element type, float by default).
    template <typename T = float> std::vector<T> variable(std::size_t index) const {
        const void *p = nullptr;
        std::size_t n = 0;
        tutti_dtype d = TUTTI_DTYPE_F32;
        detail::check(tutti_ps_step_variable(s_, index, &d, &p, &n));
        if (d != dtype_of<T>::value) {
            throw error(TUTTI_ERROR_INVALID_ARGUMENT,
                        "ps_step::variable: variable " + std::to_string(index) +
                            " is of another dtype than the one asked for");
        }
        const T *t = static_cast<const T *>(p);
        return std::vector<T>(t, t + n);
    }
    /// What the coordinator scheduled this step with.
    std::string payload() const {
        const void *p = nullptr;
        std::size_t n = 0;
        detail::check(tutti_ps_step_payload(s_, &p, &n));
        return std::string(static_cast<const char *>(p), n);
    }
    /// Variable `index`'s gradient (float32; see the template for other dtypes).
    void set_gradient(std::size_t index, const std::vector<float> &g) {
        set_gradient<float>(index, g);
    }
    /// Variable `index`'s gradient, of its dtype (the ps tasks step it by the variable's rule).
    template <typename T> void set_gradient(std::size_t index, const std::vector<T> &g) {
        detail::check(tutti_ps_step_set_gradient(s_, index, dtype_of<T>::value, g.data(),
                                                 g.size()));
    }
    /// A gradient for variable `index` stepped by `update` (not the variable's own rule).
    template <typename T>
    void push(std::size_t index, const std::vector<T> &g, const ps_update &update) {
        detail::check(tutti_ps_step_push(s_, index, dtype_of<T>::value, g.data(),
                                         g.size(), &update.u));
    }
    void set_loss(float loss) { detail::check(tutti_ps_step_set_loss(s_, loss)); }
    /// What goes back to the coordinator with the step.
    void set_output(const std::string &bytes) {
        detail::check(tutti_ps_step_set_output(s_, bytes.data(), bytes.size()));
    }

private:
    friend class ps_strategy;
    explicit ps_step(tutti_ps_step *s) : s_(s) {}
    tutti_ps_step *s_;
};

/// A scheduled step's result (TensorFlow's RemoteValue). Move-only.
class ps_remote_value {
public:
    tutti_ps_remote_value *get() const noexcept { return h_.get(); }

private:
    friend class ps_coordinator;
    explicit ps_remote_value(tutti_ps_remote_value *v) : h_(v) {}
    std::unique_ptr<tutti_ps_remote_value, detail::ps_remote_value_deleter> h_;
};

/// The chief's coordinator. Move-only; destroying it shuts the job down.
class ps_coordinator {
public:
    std::size_t num_workers() const {
        std::size_t n = 0;
        detail::check(tutti_ps_coordinator_num_workers(h_.get(), &n));
        return n;
    }
    /// An f32 variable on the ps tasks, updated by SGD at `learning_rate`, in `num_shards`
    /// shards (0: as the strategy's partitioner says); its index.
    std::size_t create_variable(const std::string &name, const std::vector<float> &initial,
                                float learning_rate, std::size_t num_shards = 0) {
        return create_variable(name, initial, ps_update::sgd(learning_rate), num_shards);
    }
    /// A variable of T (float, double, f16, bf16) on the ps tasks, stepped by `update`.
    template <typename T>
    std::size_t create_variable(const std::string &name, const std::vector<T> &initial,
                                const ps_update &update, std::size_t num_shards = 0) {
        std::size_t index = 0;
        detail::check(tutti_ps_coordinator_create_variable(
            h_.get(), name.c_str(), dtype_of<T>::value, initial.data(), initial.size(),
            num_shards, &update.u, &index, nullptr));
        return index;
    }
    /// Variable `index`, `len` elements of T, as the ps tasks hold it now.
    template <typename T = float>
    std::vector<T> read_variable(std::size_t index, std::size_t len) const {
        std::vector<T> out(len);
        detail::check(tutti_ps_coordinator_read_variable(h_.get(), index,
                                                         dtype_of<T>::value, out.data(),
                                                         len));
        return out;
    }
    /// Step variable `index` on its ps tasks by `g` from here, with `update` (an optimizer
    /// applied on the chief; ps_update::sgd(1) subtracts).
    template <typename T>
    void push(std::size_t index, const std::vector<T> &g, const ps_update &update) {
        detail::check(tutti_ps_coordinator_push(h_.get(), index, dtype_of<T>::value, g.data(),
                                                g.size(), &update.u));
    }
    /// Set variable `index` on its ps tasks (a restored checkpoint, a value of the caller's).
    template <typename T> void assign_variable(std::size_t index, const std::vector<T> &values) {
        detail::check(tutti_ps_coordinator_assign_variable(
            h_.get(), index, dtype_of<T>::value, values.data(), values.size()));
    }
    /// An update rule's state for a variable: its slots (SGD's momentum or Adam's m, and Adam's
    /// v; empty where the rule keeps none), of S (float; double for a double variable), and
    /// the steps taken. What a checkpoint keeps of an optimizer beside the variable.
    template <typename S = float> struct slots {
        std::vector<S> first, second;
        std::uint32_t steps = 0;
    };
    /// The state for variable `index` (of `len` elements) of `update` (nullptr: the variable's
    /// own rule; else a pushed rule, by its slots key), its shards' joined.
    template <typename S = float>
    slots<S> read_slots(std::size_t index, std::size_t len,
                        const ps_update *update = nullptr) const {
        const tutti_ps_update *u = update ? &update->u : nullptr;
        std::uint32_t kept = 0;
        slots<S> out;
        detail::check(tutti_ps_coordinator_read_slots(h_.get(), index, u, dtype_of<S>::value,
                                                      nullptr, nullptr, len, nullptr, &kept));
        if (kept & 1u) out.first.resize(len);
        if (kept & 2u) out.second.resize(len);
        detail::check(tutti_ps_coordinator_read_slots(
            h_.get(), index, u, dtype_of<S>::value, (kept & 1u) ? out.first.data() : nullptr,
            (kept & 2u) ? out.second.data() : nullptr, len, &out.steps, nullptr));
        return out;
    }
    /// Set that state (a restored checkpoint's), onto however many ps tasks hold the variable.
    template <typename S>
    void assign_slots(std::size_t index, const slots<S> &state,
                      const ps_update *update = nullptr) {
        std::size_t len = state.first.empty() ? state.second.size() : state.first.size();
        if (!state.first.empty() && !state.second.empty() &&
            state.first.size() != state.second.size()) {
            throw std::invalid_argument("assign_slots: the first slot holds " +
                                        std::to_string(state.first.size()) +
                                        " elements and the second " +
                                        std::to_string(state.second.size()));
        }
        detail::check(tutti_ps_coordinator_assign_slots(
            h_.get(), index, update ? &update->u : nullptr, dtype_of<S>::value,
            state.first.empty() ? nullptr : state.first.data(),
            state.second.empty() ? nullptr : state.second.data(), len, state.steps));
    }
    /// Steps 0..n on the workers; their losses.
    std::vector<float> run_steps(std::size_t n) {
        std::vector<float> losses(n);
        detail::check(tutti_ps_coordinator_run_steps(h_.get(), n, losses.data()));
        return losses;
    }
    /// Queue a step carrying `payload`; it runs at the next join or fetch.
    ps_remote_value schedule(const std::string &payload) {
        tutti_ps_remote_value *v = nullptr;
        detail::check(
            tutti_ps_coordinator_schedule(h_.get(), payload.data(), payload.size(), &v));
        return ps_remote_value(v);
    }
    /// Run everything scheduled and wait for it.
    void join() { detail::check(tutti_ps_coordinator_join(h_.get())); }
    /// A scheduled step's loss and what it sent back.
    struct output {
        float loss;
        std::string bytes;
    };
    output fetch(const ps_remote_value &v) {
        output out{0.0f, std::string()};
        std::size_t n = 0;
        detail::check(tutti_ps_coordinator_fetch(h_.get(), v.get(), &out.loss, nullptr, 0, &n));
        out.bytes.resize(n);
        detail::check(tutti_ps_coordinator_fetch(h_.get(), v.get(), nullptr,
                                                 n ? &out.bytes[0] : nullptr, n, &n));
        return out;
    }
    /// Tell every task the job is over; the coordinator is released.
    void shutdown() { detail::check(tutti_ps_coordinator_shutdown(h_.release())); }
    tutti_ps_coordinator *get() const noexcept { return h_.get(); }

    /// The strategy's scope on this thread (TensorFlow's `with strategy.scope():` on the
    /// chief), until the guard is destroyed: tutti::variable made meanwhile lives on the ps
    /// tasks, sharded by the strategy's partitioner.
    class scope_guard {
    public:
        scope_guard(const scope_guard &) = delete;
        scope_guard &operator=(const scope_guard &) = delete;
        ~scope_guard() { tutti_ps_coordinator_scope_end(c_); }

    private:
        friend class ps_coordinator;
        explicit scope_guard(tutti_ps_coordinator *c) : c_(c) {
            detail::check(tutti_ps_coordinator_scope_begin(c_));
        }
        tutti_ps_coordinator *c_;
    };
    /// Enter the scope (an error inside another strategy's scope). Not on a temporary: the
    /// coordinator must outlive its scope.
    scope_guard scope() const & { return scope_guard(h_.get()); }
    scope_guard scope() const && = delete;

private:
    friend class ps_strategy;
    explicit ps_coordinator(tutti_ps_coordinator *c) : h_(c) {}
    std::unique_ptr<tutti_ps_coordinator, detail::ps_coordinator_deleter> h_;
};

/// This task's part of a parameter-server job (tutti_ps_strategy). Move-only.
class ps_strategy {
public:
    /// `tf_config` a TF_CONFIG text, or empty for the environment's.
    explicit ps_strategy(const std::string &tf_config = std::string(),
                         partitioner p = partitioner::max_shards, std::size_t value = 1,
                         std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) {
        tutti_ps_strategy *s = nullptr;
        detail::check(tutti_ps_strategy_create(tf_config.empty() ? nullptr : tf_config.c_str(),
                                               static_cast<tutti_partitioner>(p), value,
                                               static_cast<std::uint64_t>(timeout.count()), &s));
        h_.reset(s);
    }
    /// Take this task's role: the chief gets its coordinator; a ps task or a worker serves
    /// (a worker calls step_fn(ps_step &) for each step; what it throws fails that step, with
    /// its what()) until the job is shut down, and gets none.
    template <typename F> std::unique_ptr<ps_coordinator> run_role(F &&step_fn) {
        tutti_ps_coordinator *c = nullptr;
        detail::check(tutti_ps_run_role(
            h_.get(),
            [](tutti_ps_step *st, void *user) -> tutti_result {
                try {
                    ps_step s(st);
                    (*static_cast<std::remove_reference_t<F> *>(user))(s);
                    return TUTTI_SUCCESS;
                } catch (const std::exception &e) {
                    tutti_ps_step_set_error(st, e.what());
                } catch (...) {
                    tutti_ps_step_set_error(st, "the step function threw");
                }
                return TUTTI_ERROR_SYSTEM;
            },
            const_cast<void *>(static_cast<const void *>(&step_fn)), &c));
        if (!c) {
            return nullptr;
        }
        return std::unique_ptr<ps_coordinator>(new ps_coordinator(c));
    }
    tutti_ps_strategy *get() const noexcept { return h_.get(); }

private:
    std::unique_ptr<tutti_ps_strategy, detail::ps_strategy_deleter> h_;
};

/// One device this build can see.
struct device {
    tutti_device_kind kind;
    std::size_t index;
    std::size_t physical_index;
    std::uint64_t memory_bytes; ///< 0 when unknown
    std::string name;
    std::string spec; ///< e.g. "cpu:0"
};

/// Every device this build can see.
inline std::vector<device> devices() {
    std::size_t n = 0;
    detail::check(tutti_device_count(&n));
    std::vector<device> out;
    for (std::size_t i = 0; i < n; i++) {
        tutti_device_info info = TUTTI_DEVICE_INFO_INIT;
        detail::check(tutti_device_get(i, &info));
        out.push_back(device{info.kind, info.index, info.physical_index, info.memory_bytes,
                             info.name, info.spec});
    }
    return out;
}

/// The library's version ("MAJOR.MINOR.PATCH").
inline std::string version() { return tutti_version_string(); }

} // namespace tutti

#endif // TUTTI_HPP
