// The C++ wrapper: RAII handles, typed collectives on a 4-rank group (a std::thread per rank),
// the replicas form, devices, and errors thrown as tutti::error with code and message.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tutti.hpp"

#define EXPECT(cond)                                                                               \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            std::fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond);               \
            std::exit(1);                                                                          \
        }                                                                                          \
    } while (0)

template <typename F> static void on_every_rank(std::vector<tutti::comm> &comms, F f) {
    std::vector<std::thread> threads;
    for (std::size_t r = 0; r < comms.size(); r++) {
        threads.emplace_back([&comms, r, &f] {
            try {
                f(comms[r], r);
            } catch (const tutti::error &e) {
                std::fprintf(stderr, "rank %zu: unexpected tutti::error %u: %s\n", r,
                             static_cast<unsigned>(e.code()), e.what());
                std::exit(1);
            }
        });
    }
    for (auto &t : threads) {
        t.join();
    }
}

template <typename F> static tutti::error expect_throw(F f) {
    try {
        f();
    } catch (const tutti::error &e) {
        return e;
    }
    std::fprintf(stderr, "expected a tutti::error\n");
    std::exit(1);
}

static void collectives() {
    auto comms = tutti::comm::group(4, tutti::config().timeout(std::chrono::seconds(60)).deterministic(true));
    EXPECT(comms.size() == 4);
    on_every_rank(comms, [](tutti::comm &c, std::size_t r) {
        EXPECT(c.rank() == r && c.world_size() == 4);
        EXPECT(c.timeout() == std::chrono::seconds(60));
        for (auto a : {tutti::algorithm::direct(), tutti::algorithm::ring(),
                       tutti::algorithm::hierarchical_copy(), tutti::algorithm::reduce_to_one(1)}) {
            c.set_algorithm(a);
            EXPECT(c.get_algorithm() == a);
            std::vector<float> grad(1000, static_cast<float>(r + 1));
            c.all_reduce(grad, tutti::op::mean);
            EXPECT(grad[0] == 2.5f && grad[999] == 2.5f);
            std::vector<std::int64_t> v(10, static_cast<std::int64_t>(r));
            std::vector<std::int64_t> sum(10);
            c.all_reduce(v.data(), sum.data(), v.size(), tutti::op::sum);
            EXPECT(sum[9] == 6 && v[0] == static_cast<std::int64_t>(r));
        }
        {
            // bitwise ops on an integer type; avg is mean
            std::vector<std::uint32_t> m(5, 1u << r);
            c.all_reduce(m, tutti::op::bor);
            EXPECT(m[0] == 0x0fu && m[4] == 0x0fu);
            std::vector<std::uint32_t> x(5, 0xf0u | r);
            c.all_reduce(x, tutti::op::bxor);
            EXPECT(x[0] == (0u ^ 1u ^ 2u ^ 3u));
            std::vector<std::uint32_t> y(5, 0xffu >> r);
            c.all_reduce(y, tutti::op::band);
            EXPECT(y[2] == 0x1fu);
            std::vector<float> f(3, static_cast<float>(r));
            c.all_reduce(f, tutti::op::avg);
            EXPECT(f[1] == 1.5f);
        }
        std::vector<double> b(7, r == 2 ? 3.25 : 0.0);
        c.broadcast(b, 2);
        EXPECT(b[6] == 3.25);
        {
            // shared memory (plain memory in a group of threads), released at scope end
            tutti::shared_array<float> s = c.alloc_shared<float>(1 << 16);
            EXPECT(s.size() == (1u << 16) && s[0] == 0.0f);
            for (float &x : s) {
                x = static_cast<float>(r);
            }
            c.all_reduce(s.data(), s.data(), s.size(), tutti::op::max);
            EXPECT(s[0] == 3.0f && s[s.size() - 1] == 3.0f);
            tutti::shared_array<float> moved = std::move(s);
            EXPECT(moved.data() != nullptr && s.data() == nullptr);
            // Move-assigning over a live array frees the old one (after its calls).
            tutti::shared_array<float> other = c.alloc_shared<float>(16);
            tutti::work w = c.all_reduce_async(other.data(), other.data(), other.size(),
                                               tutti::op::sum);
            other = std::move(moved);
            w.wait();
            EXPECT(other.size() == (1u << 16) && other[0] == 3.0f);
        }
        std::vector<std::uint8_t> mine(3, static_cast<std::uint8_t>(r * 10));
        auto all = c.all_gather(mine);
        EXPECT(all.size() == 12 && all[0] == 0 && all[3] == 10 && all[11] == 30);
        std::vector<std::int32_t> in(8, 1), out(2);
        c.reduce_scatter(in.data(), out.data(), 2, tutti::op::sum);
        EXPECT(out[0] == 4 && out[1] == 4);
        // Pre-multiplied: rank r scales by r + 1 (1 + 2 + 3 + 4 = 10).
        c.reduce_scatter_premul_sum(in.data(), out.data(), 2, static_cast<double>(r + 1));
        EXPECT(out[0] == 10 && out[1] == 10);
        std::vector<double> scaled(3, 0.5);
        c.all_reduce_premul_sum(scaled, static_cast<double>(r + 1));
        EXPECT(scaled[0] == 5.0 && scaled[2] == 5.0);
        std::vector<double> halves(3, 0.5), sums(3);
        std::vector<std::int32_t> slice(2);
        auto s1 = c.all_reduce_premul_sum_async(halves.data(), sums.data(), 3,
                                                static_cast<double>(r + 1));
        auto s2 = c.reduce_scatter_premul_sum_async(in.data(), slice.data(), 2,
                                                    static_cast<double>(r + 1));
        s2.wait();
        s1.wait();
        EXPECT(sums[1] == 5.0 && halves[1] == 0.5 && slice[0] == 10 && slice[1] == 10);
        std::vector<std::int32_t> red(8);
        c.reduce(in.data(), r == 0 ? red.data() : nullptr, 8, tutti::op::sum, 0);
        EXPECT(r != 0 || red[7] == 4);
        c.barrier();

        // Non-blocking: several calls in flight, waited in reverse order.
        std::vector<std::vector<float>> bufs(4, std::vector<float>(100, static_cast<float>(r)));
        std::vector<tutti::work> works;
        for (auto &buf : bufs) {
            works.push_back(c.all_reduce_async(buf.data(), buf.data(), buf.size(), tutti::op::sum));
        }
        works.push_back(c.barrier_async());
        for (std::size_t k = works.size(); k-- > 0;) {
            works[k].wait();
            EXPECT(works[k].test());
        }
        EXPECT(bufs[3][99] == 6.0f);
    });

    // A group of devices: the same calls.
    auto devs = tutti::comm::devices({"cpu:0", "cpu:1"});
    on_every_rank(devs, [](tutti::comm &c, std::size_t r) {
        std::vector<int> x(5, static_cast<int>(r) + 1);
        c.all_reduce(x, tutti::op::sum);
        EXPECT(x[4] == 3);
    });

    // Errors become exceptions with the code and tutti_last_error's text.
    on_every_rank(comms, [](tutti::comm &c, std::size_t r) {
        std::vector<float> x(r == 0 ? 5 : 6, 1.0f);
        tutti::error e = expect_throw([&] { c.all_reduce(x, tutti::op::sum); });
        EXPECT(e.code() == TUTTI_ERROR_MISMATCH);
        EXPECT(std::string(e.what()).find("count is") != std::string::npos);
        EXPECT(std::string(e.code_string()).find("different calls") != std::string::npos);
    });
}

// all_to_all(_v), gather, scatter, all_gather_v, reduce_scatter_v: vector and pointer forms,
// non-blocking forms, and counts the wrapper refuses before the C call reads them.
static void block_collectives() {
    auto comms = tutti::comm::group(3, tutti::config().timeout(std::chrono::seconds(60)));
    on_every_rank(comms, [](tutti::comm &c, std::size_t r) {
        const std::size_t p = 3;
        // all_to_all: block k of rank r's input is {10r + k, -(10r + k)}
        std::vector<std::int32_t> a2a;
        for (std::size_t k = 0; k < p; k++) {
            a2a.push_back(static_cast<std::int32_t>(10 * r + k));
            a2a.push_back(-static_cast<std::int32_t>(10 * r + k));
        }
        auto got = c.all_to_all(a2a);
        for (std::size_t k = 0; k < p; k++) {
            EXPECT(got[2 * k] == static_cast<std::int32_t>(10 * k + r));
            EXPECT(got[2 * k + 1] == -static_cast<std::int32_t>(10 * k + r));
        }
        // all_to_all_v: rank i sends rank j (i + j) % 3 elements valued 100i + j
        std::vector<std::size_t> send(p), recv(p);
        std::vector<double> v_in;
        for (std::size_t k = 0; k < p; k++) {
            send[k] = (r + k) % 3;
            recv[k] = (k + r) % 3;
            for (std::size_t i = 0; i < send[k]; i++) {
                v_in.push_back(static_cast<double>(100 * r + k));
            }
        }
        auto v_out = c.all_to_all_v(v_in, send, recv);
        std::size_t at = 0;
        for (std::size_t k = 0; k < p; k++) {
            for (std::size_t i = 0; i < recv[k]; i++) {
                EXPECT(v_out[at++] == static_cast<double>(100 * k + r));
            }
        }
        EXPECT(at == v_out.size());
        // gather and scatter at every root
        for (std::size_t root = 0; root < p; root++) {
            std::vector<std::uint8_t> mine = {static_cast<std::uint8_t>(r),
                                              static_cast<std::uint8_t>(r + root)};
            auto all = c.gather(mine, root);
            if (r == root) {
                EXPECT(all.size() == 2 * p);
                for (std::size_t k = 0; k < p; k++) {
                    EXPECT(all[2 * k] == k && all[2 * k + 1] == k + root);
                }
            } else {
                EXPECT(all.empty());
            }
            std::vector<std::int64_t> whole;
            if (r == root) {
                for (std::size_t i = 0; i < 2 * p; i++) {
                    whole.push_back(static_cast<std::int64_t>(i * 7 + root));
                }
            }
            auto part = c.scatter(whole, 2, root);
            EXPECT(part.size() == 2 && part[0] == static_cast<std::int64_t>(2 * r * 7 + root) &&
                   part[1] == static_cast<std::int64_t>((2 * r + 1) * 7 + root));
        }
        // all_gather_v and reduce_scatter_v with a zero count
        std::vector<std::size_t> counts = {2, 0, 3};
        std::vector<float> piece(counts[r], static_cast<float>(r + 1));
        auto gathered = c.all_gather_v(piece, counts);
        EXPECT((gathered == std::vector<float>{1, 1, 3, 3, 3}));
        std::vector<std::int32_t> full(5);
        for (std::size_t i = 0; i < 5; i++) {
            full[i] = static_cast<std::int32_t>(i * (r + 1));
        }
        auto mine = c.reduce_scatter_v(full, counts, tutti::op::sum);
        EXPECT(mine.size() == counts[r]);
        std::size_t off = r == 0 ? 0 : 2; // counts {2, 0, 3}: offsets 0, 2, 2
        for (std::size_t i = 0; i < mine.size(); i++) {
            EXPECT(mine[i] == static_cast<std::int32_t>(6 * (off + i))); // (1 + 2 + 3)·index
        }

        // Non-blocking forms, all in flight; the counts vectors may go once issued.
        std::vector<std::int32_t> o_a2a(2 * p), g_in = {static_cast<std::int32_t>(r)},
                                                g_out(p), s_in = {5, 6, 7}, s_out(1),
                                                agv_out(5), rs_out(counts[r]);
        std::vector<double> o_v(v_out.size());
        std::vector<float> agv_in(counts[r], static_cast<float>(r + 1)), agv_f(5);
        std::vector<tutti::work> works;
        works.push_back(c.all_to_all_async(a2a.data(), o_a2a.data(), 2));
        {
            std::vector<std::size_t> s2 = send, r2 = recv;
            works.push_back(c.all_to_all_v_async(v_in.data(), s2, o_v.data(), r2));
        }
        works.push_back(c.gather_async(g_in.data(), r == 1 ? g_out.data() : nullptr, 1, 1));
        works.push_back(c.scatter_async(r == 2 ? s_in.data() : nullptr, s_out.data(), 1, 2));
        works.push_back(c.all_gather_v_async(agv_in.data(), agv_f.data(), counts));
        works.push_back(
            c.reduce_scatter_v_async(full.data(), rs_out.data(), counts, tutti::op::max));
        for (std::size_t k = works.size(); k-- > 0;) {
            works[k].wait();
        }
        EXPECT(o_a2a == got && o_v == v_out);
        EXPECT(r != 1 || (g_out == std::vector<std::int32_t>{0, 1, 2}));
        EXPECT(s_out[0] == static_cast<std::int32_t>(5 + r));
        EXPECT(agv_f == gathered);
        for (std::size_t i = 0; i < rs_out.size(); i++) {
            EXPECT(rs_out[i] == static_cast<std::int32_t>(3 * (off + i))); // max is rank 2's
        }
    });
    // An argument error of the C API comes through with its message.
    on_every_rank(comms, [](tutti::comm &c, std::size_t r) {
        std::vector<float> x(6);
        if (r == 0) {
            tutti::error e = expect_throw([&] { c.all_to_all(x.data(), x.data() + 1, 2); });
            EXPECT(e.code() == TUTTI_ERROR_INVALID_ARGUMENT);
            EXPECT(std::string(e.what()).find("all-to-all cannot run in place") !=
                   std::string::npos);
        } else {
            tutti::error e = expect_throw([&] { c.barrier(); });
            EXPECT(e.code() == TUTTI_ERROR_ABORTED);
        }
    });

    // Counts the wrapper refuses before the C call could read past them. Each refusal aborts
    // the group (a fresh one: no rank may still be inside an earlier call), so that no peer
    // waits for a call that never comes.
    auto refusing = tutti::comm::group(3, tutti::config().timeout(std::chrono::seconds(60)));
    on_every_rank(refusing, [](tutti::comm &c, std::size_t) {
        std::vector<float> piece(2);
        std::vector<std::size_t> counts{1, 2, 2};
        tutti::error e = expect_throw([&] { c.all_gather_v(piece, std::vector<std::size_t>{2}); });
        EXPECT(e.code() == TUTTI_ERROR_INVALID_ARGUMENT);
        EXPECT(std::string(e.what()).find("all_gather_v: counts has 1 entries for a world of 3") !=
               std::string::npos);
        e = expect_throw([&] { c.all_to_all(std::vector<float>(4)); });
        EXPECT(std::string(e.what()).find("not a whole number of blocks for 3 ranks") !=
               std::string::npos);
        e = expect_throw([&] { c.reduce_scatter_v(std::vector<int>(4), counts, tutti::op::sum); });
        EXPECT(std::string(e.what()).find("holds 4 elements but the sum of counts is 5") !=
               std::string::npos);
        EXPECT(std::string(e.what()).find("the group is aborted") != std::string::npos);
        e = expect_throw([&] { c.barrier(); });
        EXPECT(e.code() == TUTTI_ERROR_ABORTED);
    });
}

static void abort_wakes_a_blocked_rank() {
    auto comms = tutti::comm::group(2, tutti::config().timeout(std::chrono::seconds(120)));
    std::atomic<bool> woke(false);
    std::thread blocked([&] {
        std::vector<float> x(4, 1.0f);
        tutti::error e = expect_throw([&] { comms[0].all_reduce(x, tutti::op::sum); });
        EXPECT(e.code() == TUTTI_ERROR_ABORTED);
        EXPECT(std::string(e.what()).find("shutting down") != std::string::npos);
        woke = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    comms[1].abort("shutting down");
    blocked.join();
    EXPECT(woke && comms[0].aborted());
}

static void moves_and_ownership() {
    auto comms = tutti::comm::group(1);
    tutti::comm moved = std::move(comms[0]);
    EXPECT(comms[0].get() == nullptr && moved.get() != nullptr);
    tutti::error e = expect_throw([&] { comms[0].barrier(); });
    EXPECT(e.code() == TUTTI_ERROR_INVALID_ARGUMENT);
    EXPECT(std::string(e.what()) == "tutti_barrier: comm is NULL");
    moved.barrier();

    // A shared array outlives its comm object: it keeps the communicator alive, and frees
    // its memory through it (under ASan, a use after free otherwise).
    tutti::shared_array<float> kept = moved.alloc_shared<float>(32);
    {
        tutti::comm gone = std::move(moved);
        kept[31] = 2.0f;
        gone.all_reduce(kept.data(), kept.data(), kept.size(), tutti::op::sum);
    }
    EXPECT(kept[31] == 2.0f);
    kept = tutti::shared_array<float>(nullptr, nullptr, 0);
    EXPECT(kept.data() == nullptr);
}

static void replicas_form() {
    tutti::replicas reps(3, tutti::config().with_algorithm(tutti::algorithm::ring()));
    EXPECT(reps.size() == 3);
    std::vector<std::vector<float>> bufs = {{1, 2}, {3, 4}, {5, 6}};
    reps.all_reduce(bufs, tutti::op::sum);
    EXPECT(bufs[0][0] == 9 && bufs[2][1] == 12);
    bufs[1] = {7, 8};
    reps.broadcast(bufs, 1);
    EXPECT(bufs[0][1] == 8 && bufs[2][0] == 7);
    std::vector<std::vector<std::int32_t>> ins = {{1}, {2}, {3}};
    auto gathered = reps.all_gather(ins);
    EXPECT(gathered.size() == 3 && gathered[2] == (std::vector<std::int32_t>{1, 2, 3}));
    auto maxed = reps.reduce(ins, tutti::op::max);
    EXPECT(maxed == std::vector<std::int32_t>{3});
    std::vector<std::vector<float>> ragged = {{1, 2}, {3}, {5, 6}};
    tutti::error e = expect_throw([&] { reps.all_reduce(ragged, tutti::op::sum); });
    EXPECT(e.code() == TUTTI_ERROR_INVALID_ARGUMENT);
    std::vector<std::vector<float>> two = {{1}, {2}};
    e = expect_throw([&] { reps.all_reduce(two, tutti::op::sum); });
    EXPECT(std::string(e.what()).find("num_buffers is 2 but there are 3 replicas") !=
           std::string::npos);
    std::vector<std::vector<tutti::bf16>> half = {{{0x3f80}}, {{0x4000}}, {{0x4040}}}; // 1, 2, 3
    reps.all_reduce(half, tutti::op::sum);
    EXPECT(half[1][0].bits == 0x40c0); // 6
}

// A loopback TCP port nothing listens on right now.
static int free_port() {
    sockaddr_in a{};
    socklen_t len = sizeof a;
    int s = socket(AF_INET, SOCK_STREAM, 0);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT(s >= 0 && bind(s, reinterpret_cast<sockaddr *>(&a), sizeof a) == 0);
    EXPECT(getsockname(s, reinterpret_cast<sockaddr *>(&a), &len) == 0);
    close(s);
    return ntohs(a.sin_port);
}

static void multi_process_errors() {
    // Joining needs a cluster; without one the error says what to set.
    tutti::error e = expect_throw([] {
        tutti::comm::join(3, 2, "127.0.0.1:1", tutti::config().transport(TUTTI_TRANSPORT_TCP));
    });
    EXPECT(e.code() == TUTTI_ERROR_INVALID_ARGUMENT);
    EXPECT(std::string(e.what()).find("rank 3 is out of range for world_size") != std::string::npos);
    e = expect_throw([] { tutti::comm::join(0, 1, "127.0.0.1:0"); });
    EXPECT(std::string(e.what()).find("port 0") != std::string::npos);
    // A one-rank job needs no peers: rank 0 serves its own rendezvous.
    tutti::comm solo = tutti::comm::join(0, 1, "127.0.0.1:" + std::to_string(free_port()));
    std::vector<float> x(3, 2.0f);
    solo.all_reduce(x, tutti::op::sum);
    EXPECT(solo.world_size() == 1 && x[2] == 2.0f);
}

static void split_groups() {
    auto comms = tutti::comm::group(3, tutti::config().timeout(std::chrono::seconds(60)));
    on_every_rank(comms, [](tutti::comm &c, std::size_t r) {
        // Ranks 0 and 2 together (2 first, by key), rank 1 without a group.
        std::unique_ptr<tutti::comm> sub = c.split(r == 1 ? -1 : 5, -static_cast<std::int64_t>(r));
        if (r == 1) {
            EXPECT(!sub);
            return;
        }
        EXPECT(sub && sub->world_size() == 2 && sub->rank() == (r == 2 ? 0u : 1u));
        std::vector<int> v{static_cast<int>(r)};
        sub->all_reduce(v, tutti::op::sum);
        EXPECT(v[0] == 2);
    });
}

static void point_to_point() {
    auto comms = tutti::comm::group(3, tutti::config().timeout(std::chrono::seconds(60)));
    on_every_rank(comms, [](tutti::comm &c, std::size_t r) {
        const std::size_t p = c.world_size(), next = (r + 1) % p, prev = (r + p - 1) % p;
        // A ring through the guard, both orders, 1 MiB each way: every rank sends first.
        std::vector<float> out(256 * 1024, static_cast<float>(r) + 0.5f), in(out.size());
        {
            tutti::group g;
            c.send(out, next);
            c.recv(in, prev);
            g.end();
        }
        EXPECT(in.front() == static_cast<float>(prev) + 0.5f && in.back() == in.front());
        // The same ring ended without waiting; a collective after it comes after it.
        std::fill(in.begin(), in.end(), 0.0f);
        {
            tutti::group g;
            c.send(out, next);
            c.recv(in, prev);
            std::optional<tutti::work> w = g.end_async();
            EXPECT(w.has_value());
            std::vector<int> one{1};
            c.all_reduce(one, tutti::op::sum);
            EXPECT(one[0] == static_cast<int>(p));
            w->wait();
            tutti::error e = expect_throw([&] { g.end(); });
            EXPECT(e.code() == TUTTI_ERROR_INVALID_ARGUMENT);
        }
        EXPECT(in.front() == static_cast<float>(prev) + 0.5f && in.back() == in.front());
        {
            tutti::group empty;
            EXPECT(!empty.end_async().has_value());
        }
        // Blocking pairs, by pointer: rank 0 to rank 1 and back.
        std::int64_t v[3] = {static_cast<std::int64_t>(r), 7, 8};
        if (r == 0) {
            c.send(v, 3, 1);
            c.recv(v, 3, 1);
            EXPECT(v[0] == 1);
        } else if (r == 1) {
            std::int64_t got[3] = {0, 0, 0};
            c.recv(got, 3, 0);
            EXPECT(got[0] == 0 && got[2] == 8);
            c.send(v, 3, 0);
        }
        // Async, sends first.
        std::vector<double> a(5, static_cast<double>(r)), b(5, -1.0);
        tutti::work s = c.send_async(a.data(), a.size(), next);
        tutti::work w = c.recv_async(b.data(), b.size(), prev);
        s.wait();
        w.wait();
        EXPECT(b[4] == static_cast<double>(prev));
        // Inside a group, collectives throw and leave the group open and the communicator
        // usable; the guard's destructor ends the group.
        {
            tutti::group g;
            tutti::error e = expect_throw([&] { c.barrier(); });
            EXPECT(e.code() == TUTTI_ERROR_INVALID_ARGUMENT);
            EXPECT(std::string(e.what()).find("only tutti_send and tutti_recv") !=
                   std::string::npos);
            g.end();
            e = expect_throw([&] { g.end(); });
            EXPECT(e.code() == TUTTI_ERROR_INVALID_ARGUMENT);
        }
        // end() throws the group's error: a send to itself without its receive.
        {
            tutti::group g;
            c.send(a, r);
            tutti::error e = expect_throw([&] { g.end(); });
            EXPECT(e.code() == TUTTI_ERROR_INVALID_ARGUMENT);
            EXPECT(std::string(e.what()).find("sends to itself") != std::string::npos);
        }
        c.barrier();
    });
}

// Strategies: run with replica collectives, reduce, batch rows, the cluster, an exception
// thrown by one replica rethrown by run; checkpoints saved through the strategy and restored.
static void strategies_and_checkpoints() {
    tutti::strategy s(tutti::strategy_kind::mirrored, 3, tutti::cross_device_ops::ring);
    EXPECT(s.num_replicas_in_sync() == 3 && s.num_local_replicas() == 3);
    std::vector<std::vector<float>> grads(3);
    s.run([&](const tutti::replica_context &ctx) {
        std::size_t i = ctx.local_replica_id();
        grads[i] = std::vector<float>(4, static_cast<float>(ctx.replica_id() + 1));
        ctx.all_reduce(grads[i], tutti::op::sum);
        std::vector<double> b(2, static_cast<double>(i));
        ctx.broadcast(b, 2);
        EXPECT(b[0] == 2.0);
    });
    for (const auto &g : grads) {
        EXPECT(g == std::vector<float>(4, 6.0f));
    }
    // TPU setup: the topology and a replica per core, or UNAVAILABLE saying why (no plugin, or a
    // library without XLA).
    try {
        tutti::tpu_topology t = tutti::initialize_tpu_system();
        EXPECT(t.num_cores == t.num_tasks * t.num_cores_per_task && t.num_cores > 0);
        tutti::strategy tpu(tutti::strategy_kind::tpu);
        EXPECT(tpu.num_local_replicas() == t.num_cores);
    } catch (const tutti::error &e) {
        EXPECT(e.code() == TUTTI_ERROR_UNAVAILABLE);
        EXPECT(std::string(e.what()).find("not available") != std::string::npos);
    }
    // Replicas on devices named as TensorFlow names them; a device that is not one, an error.
    {
        tutti::strategy named(tutti::strategy_kind::mirrored,
                              std::vector<std::string>{"/device:CPU:0", "cpu:1"});
        EXPECT(named.num_local_replicas() == 2);
        tutti::error e = expect_throw([] {
            tutti::strategy bad(tutti::strategy_kind::central_storage,
                                std::vector<std::string>{"npu:0"});
        });
        EXPECT(e.code() == TUTTI_ERROR_INVALID_ARGUMENT);
        EXPECT(std::string(e.what()).find("npu:0") != std::string::npos);
    }
    // Tensors on the replicas' devices (host memory for CPU replicas), reduced where they lie.
    s.run([&](const tutti::replica_context &ctx) {
        auto t = ctx.place(std::vector<std::int32_t>{static_cast<std::int32_t>(ctx.replica_id()), 1});
        ctx.all_reduce(t, tutti::op::sum);
        EXPECT((t.read() == std::vector<std::int32_t>{3, 3}));
        ctx.all_gather(t);
        EXPECT(t.size() == 6);
        auto h = tutti::tensor<std::int32_t>::from_host({7});
        ctx.broadcast(h, 1);
        EXPECT(h.read()[0] == 7);
    });
    // Placed on a replica's device from outside run (an input pipeline's batch).
    EXPECT((s.place_on_replica(2, std::vector<std::int32_t>{5, 6}).read() ==
            std::vector<std::int32_t>{5, 6}));
    {
        tutti::error e = expect_throw([&] { s.place_on_replica(3, std::vector<std::int32_t>{5}); });
        EXPECT(std::string(e.what()).find("no local replica 3") != std::string::npos);
    }
    std::vector<float> mean = s.reduce(std::vector<std::vector<float>>{{1, 2}, {3, 4}, {5, 6}},
                                       tutti::op::mean);
    EXPECT(mean[0] == 3.0f && mean[1] == 4.0f);
    // Scope and variables: made in the scope, a copy per replica; the mean of the updates.
    {
        auto guard = s.scope();
        tutti::variable<float> v(std::vector<float>{1, 2}, tutti::aggregation::mean);
        v.assign_add(s, {{0, 1}, {1, 1}, {2, 1}});
        EXPECT(v.value() == (std::vector<float>{2, 3}));
        s.run([&](const tutti::replica_context &ctx) {
            EXPECT(v.read(ctx) == (std::vector<float>{2, 3}));
        });
    }
    // A device variable: copies on the replicas' devices, each replica's update where it lies.
    {
        tutti::device_variable<float> w(s, {10, 10});
        s.run([&](const tutti::replica_context &ctx) {
            auto g = ctx.place(std::vector<float>{static_cast<float>(ctx.replica_id()), 3});
            w.assign_sub(ctx, g, tutti::aggregation::mean);
        });
        for (std::size_t r = 0; r < 3; r++) {
            EXPECT(w.read(r) == (std::vector<float>{9, 7}));
        }
        tutti::error e = expect_throw([&] { w.read(3); });
        EXPECT(std::string(e.what()).find("no replica 3") != std::string::npos);
        // An optimizer steps it there: momentum SGD by the sum {0 + 1 + 2, 3 + 3 + 3}
        // (v = -0.5 * sum, then 0.5 v - 0.5 sum).
        tutti::optimizer opt(tutti::ps_update::sgd(0.5f, 0.5f));
        auto step = [&](tutti::optimizer &o) {
            s.run([&](const tutti::replica_context &ctx) {
                auto g = ctx.place(std::vector<float>{static_cast<float>(ctx.replica_id()), 3});
                o.apply_gradients(ctx, g, w);
                EXPECT((g.read() == std::vector<float>{3, 9}));
            });
        };
        step(opt);
        EXPECT(w.value() == (std::vector<float>{7.5f, 2.5f}) && opt.iterations() == 1);
        tutti::checkpoint ck(1);
        opt.save<float>(ck, "opt", {{"w", &w}});
        EXPECT(ck.read<float>("opt/w/momentum") == (std::vector<float>{-1.5f, -4.5f}));
        // Restored into another optimizer, the momentum carries on: v = {-2.25, -6.75}.
        tutti::optimizer again(tutti::ps_update::sgd(0.5f, 0.5f));
        again.restore<float>(ck, "opt", {{"w", &w}});
        EXPECT(again.iterations() == 1);
        step(again);
        EXPECT(w.value() == (std::vector<float>{5.25f, -4.25f}) && again.iterations() == 2);
        // At a learning rate set between steps: v = 0.5 v - 0.25 sum = {-1.875, -5.625}.
        again.set_learning_rate(0.25f);
        EXPECT(again.learning_rate() == 0.25f);
        step(again);
        EXPECT(w.value() == (std::vector<float>{3.375f, -9.875f}));
    }
    {
        tutti::variable<double> plain(std::vector<double>{1});
        tutti::error e0 = expect_throw([&] { plain.assign(s, {{1}, {2}, {3}}); });
        EXPECT(std::string(e0.what()).find("3 updates for 1 replicas") != std::string::npos);
    }
    {
        auto mw = tutti::strategy::multi_worker(tutti::communication::ring, nullptr, 2);
        EXPECT(mw.num_local_replicas() == 2 && mw.num_replicas_in_sync() == 2);
        // With CommunicationOptions' pack size and timeout.
        auto packed = tutti::strategy::multi_worker(tutti::communication::ring, nullptr, 2, 4096,
                                                    std::chrono::milliseconds(5000));
        EXPECT(packed.num_replicas_in_sync() == 2);
        // On named devices.
        auto named = tutti::strategy::multi_worker({"cpu:0", "/device:CPU:1", "CPU:2"},
                                                   tutti::communication::ring);
        EXPECT(named.num_local_replicas() == 3 && named.num_replicas_in_sync() == 3);
        tutti::error twice =
            expect_throw([] { tutti::strategy::multi_worker({"cpu:0", "/cpu:0"}); });
        EXPECT(std::string(twice.what()).find("both name cpu:0") != std::string::npos);
        // One worker: none to shrink to (a clear error, not a crash).
        tutti::error e = expect_throw([&] { mw.shrink(); });
        EXPECT(std::string(e.what()).find("shrink") != std::string::npos);
    }
    {
        // A replica's exception: rethrown here, and its message is the run's error too.
        tutti::strategy two(tutti::strategy_kind::mirrored, 2, tutti::cross_device_ops::ring);
        bool rethrown = false;
        try {
            two.run([&](const tutti::replica_context &ctx) {
                if (ctx.local_replica_id() == 1) {
                    throw std::runtime_error("the loss is NaN");
                }
            });
        } catch (const std::runtime_error &e) {
            rethrown = std::string(e.what()) == "the loss is NaN";
        }
        EXPECT(rethrown);
        EXPECT(tutti::detail::last_error().find("the loss is NaN") != std::string::npos);
    }
    // Gather: uneven rows, in replica order.
    std::vector<double> all = s.gather(std::vector<std::vector<double>>{{1, 2}, {}, {3, 4, 5, 6}}, 2, 10);
    EXPECT(all == (std::vector<double>{1, 2, 3, 4, 5, 6}));
    tutti_cross_device_ops_config hc = TUTTI_CROSS_DEVICE_OPS_CONFIG_INIT;
    hc.kind = TUTTI_CROSS_DEVICE_OPS_HIERARCHICAL_COPY;
    hc.group_size = 3;
    tutti::strategy grouped(3, hc);
    grouped.run([](const tutti::replica_context &ctx) {
        std::vector<double> x(1, static_cast<double>(ctx.replica_id()));
        ctx.all_reduce(x, tutti::op::sum);
        EXPECT(x[0] == 3.0);
    });
    auto rows = s.batch_rows(10);
    EXPECT(rows.size() == 3 && rows[0].first == 0 && rows[0].second == 4 && rows[2].second == 10);
    auto cluster = s.cluster();
    EXPECT(cluster.task_id == 0 && cluster.num_workers == 1 && cluster.is_chief);
    try {
        s.run([](const tutti::replica_context &ctx) {
            if (ctx.local_replica_id() == 1) {
                throw std::runtime_error("replica 1 gave up");
            }
            std::vector<float> x(1, 1.0f);
            ctx.all_reduce(x, tutti::op::sum);
        });
        EXPECT(false);
    } catch (const std::runtime_error &e) {
        EXPECT(std::string(e.what()) == "replica 1 gave up");
    }
    // Still usable.
    s.run([](const tutti::replica_context &ctx) {
        std::vector<int> x(1, 1);
        ctx.all_reduce(x, tutti::op::sum);
        EXPECT(x[0] == 3);
    });

    char dir[] = "/tmp/tutti-cpp-ckpt-XXXXXX";
    EXPECT(mkdtemp(dir) != nullptr);
    EXPECT(tutti::checkpoint::restore(dir, &s) == nullptr);
    for (std::uint64_t step = 10; step <= 30; step += 10) {
        tutti::checkpoint c(step);
        c.insert("w", std::vector<std::size_t>{2, 2}, grads[0].data());
        c.insert("counter", std::vector<std::int64_t>{static_cast<std::int64_t>(step)});
        c.save(dir, 2, &s);
    }
    auto back = tutti::checkpoint::restore(dir);
    EXPECT(back && back->step() == 30);
    EXPECT(back->shape("w") == (std::vector<std::size_t>{2, 2}));
    EXPECT(back->read<float>("w") == grads[0]);
    EXPECT(back->read<std::int64_t>("counter")[0] == 30);
    tutti::error e = expect_throw([&] { back->read<double>("w"); });
    EXPECT(e.code() == TUTTI_ERROR_INVALID_ARGUMENT);
    e = expect_throw([&] { back->shape("bias"); });
    EXPECT(std::string(e.what()).find("bias") != std::string::npos);
    std::string ckpt = std::string(dir) + "/ckpt-";
    EXPECT(access((ckpt + "10.tutti").c_str(), F_OK) != 0);
    for (const char *step : {"20", "30"}) {
        EXPECT(std::remove((ckpt + step + ".tutti").c_str()) == 0);
    }
    EXPECT(rmdir(dir) == 0);
}

// Parameter servers: a ps task and two workers on threads, the chief's coordinator scheduling
// steps with payloads; a step whose function throws fails join with its what(); the
// strategy's scope, whose variables live on the ps task.
static void parameter_servers() {
    int ports[4];
    for (int &p : ports) {
        p = free_port();
    }
    char cluster[512];
    std::snprintf(cluster, sizeof cluster,
                  "{\"chief\": [\"127.0.0.1:%d\"], \"ps\": [\"127.0.0.1:%d\"], "
                  "\"worker\": [\"127.0.0.1:%d\", \"127.0.0.1:%d\"]}",
                  ports[0], ports[1], ports[2], ports[3]);
    auto config = [&](const char *type, int index) {
        return std::string("{\"cluster\": ") + cluster + ", \"task\": {\"type\": \"" + type +
               "\", \"index\": " + std::to_string(index) + "}}";
    };
    setenv("TUTTI_JOB_TOKEN", "cpp-parameter-server-test-token", 1);
    auto step_fn = [](tutti::ps_step &st) {
        std::string p = st.payload();
        if (p == "throw") {
            throw std::runtime_error("thrown by the C++ step");
        }
        EXPECT(st.num_workers() == 2 && st.num_variables() == 2);
        std::vector<float> w = st.variable(0);
        st.set_gradient(0, std::vector<float>(w.size(), 1.0f));
        // Momentum on the ps task, for a float64 variable.
        EXPECT(st.variable<double>(1).size() == 2);
        st.push(1, std::vector<double>(2, 1.0), tutti::ps_update::sgd(0.1f, 0.9f, false, 5));
        st.set_loss(static_cast<float>(st.step()));
        st.set_output(p + ":" + std::to_string(st.worker()));
    };
    std::vector<std::thread> tasks;
    std::atomic<int> served{0};
    for (auto t : {std::make_pair("ps", 0), std::make_pair("worker", 0), std::make_pair("worker", 1)}) {
        std::string c = config(t.first, t.second);
        tasks.emplace_back([c, step_fn, &served] {
            tutti::ps_strategy s(c, tutti::partitioner::fixed_shards, 2, std::chrono::seconds(30));
            auto coordinator = s.run_role(step_fn);
            EXPECT(coordinator == nullptr);
            served++;
        });
    }
    tutti::ps_strategy chief(config("chief", 0), tutti::partitioner::fixed_shards, 2,
                             std::chrono::seconds(30));
    auto coordinator = chief.run_role(step_fn);
    EXPECT(coordinator != nullptr && coordinator->num_workers() == 2);
    std::size_t w = coordinator->create_variable("w", std::vector<float>(4, 10.0f), 0.5f);
    std::size_t m = coordinator->create_variable("m", std::vector<double>(2, 0.0),
                                                 tutti::ps_update::sgd(1.0f), 1);
    EXPECT(m == 1);
    std::vector<tutti::ps_remote_value> values;
    for (int i = 0; i < 4; i++) {
        values.push_back(coordinator->schedule("step" + std::to_string(i)));
    }
    coordinator->join();
    for (int i = 0; i < 4; i++) {
        auto out = coordinator->fetch(values[i]);
        EXPECT(out.loss == static_cast<float>(i));
        EXPECT(out.bytes.rfind("step" + std::to_string(i) + ":", 0) == 0);
    }
    EXPECT(coordinator->read_variable(w, 4) == std::vector<float>(4, 8.0f));
    // v = -0.1, -0.19, -0.271, -0.3439: their sum.
    double m0 = coordinator->read_variable<double>(m, 2)[0];
    EXPECT(m0 + 0.9049 < 1e-5 && m0 + 0.9049 > -1e-5);
    // The momentum the ps tasks keep under key 5 (double, as the variable): v after 4 steps.
    auto sgd5 = tutti::ps_update::sgd(0.1f, 0.9f, false, 5);
    auto v = coordinator->read_slots<double>(m, 2, &sgd5);
    EXPECT(v.first.size() == 2 && v.second.empty() && v.steps == 0);
    EXPECT(v.first[0] + 0.3439 < 1e-5 && v.first[0] + 0.3439 > -1e-5);
    EXPECT(coordinator->read_slots(w, 4).first.empty()); // plain SGD keeps none
    v.first = {0.0, 0.0};
    coordinator->assign_slots(m, v, &sgd5);
    EXPECT(coordinator->read_slots<double>(m, 2, &sgd5).first == (std::vector<double>(2, 0.0)));
    coordinator->push(m, std::vector<double>(2, 1.0), tutti::ps_update::sgd(1.0f));
    m0 = coordinator->read_variable<double>(m, 2)[0];
    EXPECT(m0 + 1.9049 < 1e-5 && m0 + 1.9049 > -1e-5);
    tutti::error e0 = expect_throw([&] { coordinator->read_variable<float>(m, 2); });
    EXPECT(std::string(e0.what()).find("has 2 f64") != std::string::npos);
    coordinator->assign_variable(w, std::vector<float>{1, 2, 3, 4});
    EXPECT(coordinator->read_variable(w, 4) == (std::vector<float>{1, 2, 3, 4}));
    auto thrown = coordinator->schedule("throw");
    tutti::error e = expect_throw([&] { coordinator->join(); });
    EXPECT(e.code() == TUTTI_ERROR_STEP_FAILED);
    EXPECT(std::string(e.what()).find("thrown by the C++ step") != std::string::npos);
    e = expect_throw([&] { coordinator->fetch(thrown); });
    EXPECT(e.code() == TUTTI_ERROR_STEP_FAILED);
    EXPECT(coordinator->run_steps(2) == (std::vector<float>{0.0f, 1.0f}));
    // The strategy's scope on the chief: a tutti::variable made in it lives on the ps task.
    {
        auto scope = coordinator->scope();
        tutti::variable<float> b(std::vector<float>{1, 2}, tutti::aggregation::sum);
        EXPECT(b.ps_index() == 2);
        b.assign_add(std::vector<float>{1, 1});
        EXPECT(b.value() == (std::vector<float>{2, 3}));
        b.assign(std::vector<float>{5, 6});
        b.assign_sub(std::vector<float>{1, 1});
        EXPECT(coordinator->read_variable(b.ps_index(), 2) == (std::vector<float>{4, 5}));
    }
    tutti::variable<float> plain(std::vector<float>{1});
    tutti::error e1 = expect_throw([&] { plain.ps_index(); });
    EXPECT(std::string(e1.what()).find("coordinator's scope") != std::string::npos);
    coordinator->shutdown();
    for (auto &t : tasks) {
        t.join();
    }
    EXPECT(served == 3);
}

int main() {
    EXPECT(tutti::version() == TUTTI_VERSION_STRING);
    auto devs = tutti::devices();
    EXPECT(!devs.empty() && devs[0].spec == "cpu:0" && devs[0].kind == TUTTI_DEVICE_CPU);
    tutti::error e = expect_throw([] { tutti::comm::group(0); });
    EXPECT(e.code() == TUTTI_ERROR_INVALID_ARGUMENT);
    EXPECT(std::string(e.what()).find("at least one rank") != std::string::npos);
    collectives();
    block_collectives();
    split_groups();
    point_to_point();
    abort_wakes_a_blocked_rank();
    moves_and_ownership();
    replicas_form();
    multi_process_errors();
    strategies_and_checkpoints();
    parameter_servers();
    std::printf("tutti.hpp: ok\n");
    return 0;
}
