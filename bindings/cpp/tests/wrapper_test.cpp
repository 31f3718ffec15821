// The C++ wrapper: RAII handles, typed collectives on a 4-rank group (a std::thread per rank),
// the replicas form, devices, and errors thrown as tutti::error with code and message.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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
    auto comms = tutti::comm::group(4, tutti::config().timeout(std::chrono::seconds(60)));
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

int main() {
    EXPECT(tutti::version() == TUTTI_VERSION_STRING);
    auto devs = tutti::devices();
    EXPECT(!devs.empty() && devs[0].spec == "cpu:0" && devs[0].kind == TUTTI_DEVICE_CPU);
    tutti::error e = expect_throw([] { tutti::comm::group(0); });
    EXPECT(e.code() == TUTTI_ERROR_INVALID_ARGUMENT);
    EXPECT(std::string(e.what()).find("at least one rank") != std::string::npos);
    collectives();
    abort_wakes_a_blocked_rank();
    moves_and_ownership();
    replicas_form();
    multi_process_errors();
    std::printf("tutti.hpp: ok\n");
    return 0;
}
