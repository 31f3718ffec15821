// A C++ consumer of an installed tutti (CMakeLists.txt beside it): four threads, one
// communicator each, average their gradients; then the one-call replicas form sums and gathers.
// Every value is checked; a wrong one, or a thrown tutti::error, exits nonzero.
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <tutti.hpp>

namespace {

constexpr std::size_t kRanks = 4;
constexpr std::size_t kCount = 1024;

int failures = 0;

void expect(bool ok, const std::string &what) {
    if (!ok) {
        std::fprintf(stderr, "wrong: %s\n", what.c_str());
        ++failures;
    }
}

} // namespace

int main() {
    try {
        // The header, the library and the CMake package are one version.
        expect(tutti::version() == TUTTI_VERSION_STRING,
               "library " + tutti::version() + " with header " TUTTI_VERSION_STRING);
        expect(std::string(TUTTI_PACKAGE_VERSION) == TUTTI_VERSION_STRING,
               "CMake package " TUTTI_PACKAGE_VERSION " with header " TUTTI_VERSION_STRING);

        // A local group: rank r's gradient is r everywhere; the mean is 1.5.
        auto comms = tutti::comm::group(
            kRanks, tutti::config()
                        .timeout(std::chrono::seconds(30))
                        .with_algorithm(tutti::algorithm::ring()));
        std::vector<std::vector<float>> grads(kRanks);
        std::vector<std::string> errors(kRanks);
        std::vector<std::thread> threads;
        for (std::size_t r = 0; r < kRanks; ++r) {
            threads.emplace_back([&, r] {
                try {
                    grads[r].assign(kCount, static_cast<float>(comms[r].rank()));
                    comms[r].all_reduce(grads[r], tutti::op::mean);
                } catch (const tutti::error &e) {
                    errors[r] = e.what();
                    comms[r].abort("a rank failed");
                }
            });
        }
        for (auto &t : threads) {
            t.join();
        }
        for (std::size_t r = 0; r < kRanks; ++r) {
            expect(errors[r].empty(), "rank " + std::to_string(r) + ": " + errors[r]);
            for (std::size_t i = 0; i < kCount && errors[r].empty(); ++i) {
                if (grads[r][i] != 1.5f) {
                    expect(false, "group mean at rank " + std::to_string(r) + " [" +
                                      std::to_string(i) + "] = " + std::to_string(grads[r][i]));
                    break;
                }
            }
        }

        // The replicas form: one caller passes every replica's buffer.
        tutti::replicas reps(kRanks);
        std::vector<std::vector<std::int64_t>> bufs(kRanks);
        for (std::size_t r = 0; r < kRanks; ++r) {
            bufs[r] = {static_cast<std::int64_t>(r + 1), static_cast<std::int64_t>(10 * (r + 1))};
        }
        auto gathered = reps.all_gather(bufs);
        reps.all_reduce(bufs, tutti::op::sum);
        for (std::size_t r = 0; r < kRanks; ++r) {
            expect(bufs[r] == std::vector<std::int64_t>{10, 100},
                   "replicas sum at replica " + std::to_string(r));
            expect(gathered[r] == std::vector<std::int64_t>{1, 10, 2, 20, 3, 30, 4, 40},
                   "replicas all_gather at replica " + std::to_string(r));
        }
    } catch (const tutti::error &e) {
        std::fprintf(stderr, "tutti::error %s: %s\n", e.code_string(), e.what());
        return 1;
    }
    if (failures != 0) {
        return 1;
    }
    std::printf("ok: tutti %s found by CMake; group mean and replicas sum/all_gather right\n",
                tutti::version().c_str());
    return 0;
}
